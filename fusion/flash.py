"""Library kernels modelled on SBUF-tiled (flash) kernels: attention and cross-entropy.

Entry points: :func:`match_attention` and :func:`match_cross_entropy`, two matchers of the
pattern table (``fusion/patterns.py``, where the rules every match follows are written).

A flash kernel streams its inputs through on-chip memory in tiles and never writes the
``rows x columns`` matrix it normalizes (attention's scores ``S = QK^T``, cross-entropy's
log-probabilities) to device memory, at any size: per row it keeps a running maximum and
sum, and writes their log-sum-exp (one float32 per row), from which its backward
recomputes the matrix (TorchNeuron's NKI kernel library has such attention kernels). So:

- attention's traffic is Q, K, V and O (and the mask it reads), plus the logsumexp when
  autograd keeps the softmax output for backward;
- cross-entropy's is the logits read once, the target, the loss, plus the logsumexp
  when autograd keeps the log-probabilities.

The simulation still stores the matrix autograd keeps (its backward ops read it): the
kernel's *cost* counts the logsumexp in its place (``Match.charges``). FLOPs are the ops'
own. The backward ops are not a library kernel: they read the kept matrix, as a flash
backward reads the logits or Q and K to recompute it.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from adaptive_eager_device.storage import DeviceStorage, ViewRef

from .matching import Context, Match

_LSE_ITEMSIZE = 4  # the logsumexp is float32


def _lse_bytes(shape) -> int:
    """Bytes of one float32 per row of a matrix of this shape (rows: all but the last dim)."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows * _LSE_ITEMSIZE



def match_attention(ctx: Context, root: int):
    """Attention written by hand, as matmul lowers it: bmm(q, k^T), times (or divided by) a
    scale, an optional additive or masked_fill(mask, -inf) mask, softmax over the last dim,
    bmm with v -> one kernel that scales, masks and normalizes the scores in place. In
    training the softmax output is kept for backward: the simulation writes it back too,
    and the cost counts the logsumexp a flash kernel writes instead (module docstring)."""
    if ctx.name(root) != "aten::bmm":
        return None
    probs = ctx.source_reshaped(root, 0, "aten::_softmax")
    if probs is None or ctx.arg(probs, 2) is not False:
        return None
    shape = ctx.records[probs].results[0].shape
    if len(shape) != 4 or ctx.arg(probs, 1) not in (-1, 3):
        return None
    before = ctx.source(probs, 0)
    if before is None:
        return None
    masking, checks = None, []
    if ctx.name(before) == "aten::add" and ctx.records[before].kwargs.get("alpha", 1) == 1:
        masking, scaled = "add", ctx.source(before, 0)
    elif ctx.name(before) == "aten::masked_fill" and ctx.arg(before, 2) == float("-inf"):
        masking, scaled = "fill", ctx.source(before, 0)
        checks.append((before, 2, float("-inf")))
    else:
        scaled = before
    if scaled is None or ctx.name(scaled) not in ("aten::mul", "aten::div"):
        return None
    factor = ctx.arg(scaled, 1)
    if type(factor) is not float:
        return None
    scores = ctx.source_reshaped(scaled, 0, "aten::bmm")
    if scores is None or ctx.records[scaled].results[0].shape != shape:
        return None
    batch, heads = shape[0], shape[1]
    dtype = ctx.records[scores].results[0].dtype
    if ctx.records[scores].results[0].shape[0] != batch * heads or ctx.records[before].results[0].dtype != dtype:
        return None  # (in place, a mask of a wider dtype could not promote the scores)
    mask = ctx.arg(before, 1) if masking else None
    if masking and type(mask) not in (DeviceStorage, ViewRef):
        return None
    chain = [scores, scaled] + ([before] if masking else [])
    if not (all(ctx.private(p, 1) for p in chain) and ctx.exportable(probs, 1, root)):
        return "intermediate escapes or is shared"
    export = ctx.needed_after(probs, root)
    checks.append((scaled, 1, factor))
    inputs = [(scores, 0), (scores, 1), (root, 1)] + ([(before, 1)] if masking else [])
    return Match(
        "attention", chain + [probs, root], _attention if masking else _attention_unmasked, inputs,
        [(root, 0)] + ([(probs, 0)] if export else []), checks,
        constants={"factor": factor, "divide": ctx.name(scaled) == "aten::div", "batch": batch, "heads": heads,
                   "fill": masking == "fill", "export": export},
        charges=[(probs, 0, _lse_bytes(shape))] if export else [],  # a flash kernel writes the lse, not S
    )


def _attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], factor: float,
               divide: bool, batch: int, heads: int, fill: bool, export: bool) -> List[torch.Tensor]:
    """The hand-written ops themselves, with the scores scaled, masked and normalized in
    place: bit-identical to them, with two buffers fewer. (scaled_dot_product_attention
    measured 1.6-2x slower than the chain on this CPU, so it is not the library kernel.)"""
    scores = torch.bmm(q, kt)
    if divide:
        scores.div_(factor)
    else:
        scores.mul_(factor)
    scores4 = scores.view(batch, heads, scores.size(1), scores.size(2))
    if mask is not None:
        if fill:
            scores4.masked_fill_(mask, float("-inf"))
        else:
            scores4.add_(mask)
    probs = torch._softmax(scores4, -1, False)
    out = torch.bmm(probs.view(scores.size(0), scores.size(1), scores.size(2)), v)
    return [out, probs] if export else [out]


def _attention_unmasked(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, factor: float, divide: bool, batch: int,
                        heads: int, fill: bool, export: bool) -> List[torch.Tensor]:
    return _attention(q, kt, v, None, factor, divide, batch, heads, fill, export)




def match_cross_entropy(ctx: Context, root: int):
    """_log_softmax(x, d) -> nll_loss_forward(that, target), no class weights ->
    one pass over the logits. In training autograd keeps the log-probabilities: the
    simulation writes them back, the cost counts their logsumexp (module docstring)."""
    if ctx.name(root) != "aten::nll_loss_forward" or ctx.arg(root, 2) is not None:
        return None
    log_probs = ctx.source(root, 0, "aten::_log_softmax")
    target = ctx.arg(root, 1)
    if log_probs is None or ctx.arg(log_probs, 2) is not False or type(target) not in (DeviceStorage, ViewRef):
        return None
    reduction, ignore_index, dim = ctx.arg(root, 3), ctx.arg(root, 4), ctx.arg(log_probs, 1)
    if not all(type(value) is int for value in (reduction, ignore_index, dim)):
        return None
    if not ctx.exportable(log_probs, 1, root):
        return "intermediate escapes or is shared"
    export = ctx.needed_after(log_probs, root)
    shape = ctx.records[log_probs].results[0].shape
    return Match(
        "cross_entropy", [log_probs, root], _cross_entropy, [(log_probs, 0), (root, 1)],
        [(root, 0), (root, 1)] + ([(log_probs, 0)] if export else []),
        constants={"dim": dim, "reduction": reduction, "ignore_index": ignore_index, "export": export},
        charges=[(log_probs, 0, _lse_bytes(shape))] if export else [],
    )


def _cross_entropy(x: torch.Tensor, target: torch.Tensor, dim: int, reduction: int, ignore_index: int,
                   export: bool) -> List[torch.Tensor]:
    """The two ops themselves: bit-identical to them."""
    log_probs = torch.ops.aten._log_softmax(x, dim, False)
    loss, total_weight = torch.ops.aten.nll_loss_forward(log_probs, target, None, reduction, ignore_index)
    return [loss, total_weight, log_probs] if export else [loss, total_weight]


def _storage(ref):
    return ref.storage if type(ref) is ViewRef else ref if type(ref) is DeviceStorage else None


def _bmm_reading(ctx: Context, storage, before: int, exclude=()):
    """The unclaimed bmm before ``before`` that reads ``storage`` (one), or None."""
    found = [r for r in ctx.readers.get(storage, ()) if r < before and r not in exclude and r not in ctx.claimed
             and ctx.name(r) == "aten::bmm"]
    return found[0] if len(set(found)) == 1 else None


def match_attention_backward(ctx: Context, root: int):
    """Autograd's backward of the attention chain: dV = P^T dO, dP = dO V^T,
    dS = softmax_backward(dP, P) (masked_fill(mask, 0)) * scale, dQ and dK from two bmms
    reading dS -> one flash backward kernel. It reads Q, K, V, dO, O and the logsumexp,
    not P (charged so: module docstring), and writes dQ, dK and dV."""
    if ctx.name(root) != "aten::bmm":
        return None
    for index in (1, 0):
        scaled = ctx.source_reshaped(root, index, "aten::mul") or ctx.source_reshaped(root, index, "aten::div")
        if scaled is not None:
            break
    else:
        return None
    factor = ctx.arg(scaled, 1)
    if type(factor) is not float:
        return None
    masked = ctx.source(scaled, 0, "aten::masked_fill")
    grad = ctx.source(masked if masked is not None else scaled, 0, "aten::_softmax_backward_data")
    if grad is None or (masked is not None and ctx.arg(masked, 2) != 0):
        return None
    probs = ctx.arg(grad, 1)
    dp = ctx.source_reshaped(grad, 0, "aten::bmm")
    if type(probs) is not DeviceStorage or dp is None or len(probs.shape) != 4 or ctx.arg(grad, 2) not in (-1, 3):
        return None
    if ctx.arg(grad, 3) != probs.dtype:
        return None
    scaled_storage = ctx.records[scaled].results[0]
    other = _bmm_reading(ctx, scaled_storage, root)
    dv = _bmm_reading(ctx, probs, root, exclude=(grad,))
    if other is None or dv is None or _storage(ctx.arg(dv, 1)) is not _storage(ctx.arg(dp, 0)):
        return None
    if any(reader < root for out in (dv, other) for reader in ctx.readers.get(ctx.records[out].results[0], ())):
        return None  # (the kernel runs at its last op: no one may read its outputs before)
    other_index = 1 if _storage(ctx.arg(other, 1)) is scaled_storage else 0
    chain = [dp, grad] + ([masked] if masked is not None else [])
    if not (all(ctx.private(p, 1) for p in chain) and ctx.private(scaled, 2)):
        return "intermediate escapes or is shared"
    batch, heads, queries = probs.shape[0], probs.shape[1], probs.shape[2]
    grad_out = ctx.arg(dp, 0)
    lse_and_o = batch * heads * queries * _LSE_ITEMSIZE + math.prod(grad_out.shape) * _storage(grad_out).dtype.itemsize
    inputs = [(dv, 0), (dv, 1), (dp, 0), (dp, 1), (grad, 1), (other, 1 - other_index), (root, 1 - index)]
    checks = [(scaled, 1, factor)] + ([(masked, 2, 0)] if masked is not None else [])
    return Match(
        "attention_backward", [dv, dp, grad, scaled, other, root] + ([masked] if masked is not None else []),
        _attention_backward if masked is not None else _attention_backward_unmasked,
        inputs + ([(masked, 1)] if masked is not None else []),
        [(dv, 0), (other, 0), (root, 0)], checks,
        constants={"factor": factor, "divide": ctx.name(scaled) == "aten::div", "other_index": other_index,
                   "root_index": index},
        charges=[(grad, ~1, lse_and_o)],  # P is recomputed from Q, K and the lse; D = rowsum(dO * O) reads O
    )


def _attention_backward(pt: torch.Tensor, grad_v: torch.Tensor, grad_p: torch.Tensor, vt: torch.Tensor,
                        probs: torch.Tensor, other: torch.Tensor, last: torch.Tensor, mask: Optional[torch.Tensor],
                        factor: float, divide: bool, other_index: int, root_index: int) -> List[torch.Tensor]:
    """The backward's ops themselves, in their order: bit-identical to them."""
    dv = torch.bmm(pt, grad_v)
    dp = torch.bmm(grad_p, vt)
    ds = torch._softmax_backward_data(dp.view(probs.shape), probs, -1, probs.dtype)
    if mask is not None:
        ds = ds.masked_fill(mask, 0)
    ds = ds / factor if divide else ds * factor
    ds3 = ds.view(-1, ds.size(-2), ds.size(-1))
    first = torch.bmm(other, ds3) if other_index == 1 else torch.bmm(ds3, other)
    second = torch.bmm(last, ds3) if root_index == 1 else torch.bmm(ds3, last)
    return [dv, first, second]


def _attention_backward_unmasked(pt: torch.Tensor, grad_v: torch.Tensor, grad_p: torch.Tensor, vt: torch.Tensor,
                                 probs: torch.Tensor, other: torch.Tensor, last: torch.Tensor, factor: float,
                                 divide: bool, other_index: int, root_index: int) -> List[torch.Tensor]:
    return _attention_backward(pt, grad_v, grad_p, vt, probs, other, last, None, factor, divide, other_index,
                               root_index)
