"""Library kernels modelled on SBUF-tiled (flash) kernels: attention and cross-entropy.

Entry points: :data:`ATTENTION`, :data:`ATTENTION_BACKWARD` and :data:`CROSS_ENTROPY`,
three entries of the pattern table (``fusion/patterns.py``, where the rules every match
follows are written). Attention's backward is found through the readers of the kept
softmax output, not its producers: it keeps a matcher of its own.

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
from adaptive_eager_device.memory.storage import DeviceStorage, ViewRef

from .matching import Context, Match
from .pattern_form import ANY, Alt, Arg, Custom, Is, Op, Pattern

_LSE_ITEMSIZE = 4  # the logsumexp is float32


def _lse_bytes(shape) -> int:
    """Bytes of one float32 per row of a matrix of this shape (rows: all but the last dim)."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows * _LSE_ITEMSIZE



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


# -- the table entries ------------------------------------------------------------------


def _is_tensor(ref) -> bool:
    return type(ref) in (DeviceStorage, ViewRef)


def _is_int(value) -> bool:
    return type(value) is int


def _scaled(op: str, divide: bool) -> Op:
    """``bmm(q, k^T)`` (seen through matmul's reshapes) times or divided by a float scale."""
    scores = Op("aten::bmm", name="scores", view=True)
    return Op(op, scores, Arg("factor", lambda value: type(value) is float), name="scaled", let={"divide": divide})


_SCALED = Alt(_scaled("aten::mul", False), _scaled("aten::div", True))
_MASKED = Alt(  # + mask, or masked_fill(mask, -inf), or no mask
    Op("aten::add", _SCALED, Arg("mask", _is_tensor), kwargs={"alpha": 1}, name="mask_add",
       let={"impl": _attention, "fill": False}),
    Op("aten::masked_fill", _SCALED, Arg("mask", _is_tensor), float("-inf"), name="mask_fill",
       let={"impl": _attention, "fill": True}),
    _SCALED,
)


def _attention_shapes(ctx: Context, bound) -> bool:
    """4-d scores (batch, heads, queries, keys) from a 3-d bmm over batch x heads, the mask
    no wider a dtype than the scores (in place, it could not promote them)."""
    shape = ctx.records[bound["probs"]].results[0].shape
    if len(shape) != 4:
        return False
    scores = ctx.records[bound["scores"]].results[0]
    before = bound.get("mask_add", bound.get("mask_fill", bound["scaled"]))
    return (ctx.records[bound["scaled"]].results[0].shape == shape and scores.shape[0] == shape[0] * shape[1]
            and ctx.records[before].results[0].dtype == scores.dtype)


def _attention_constants(ctx: Context, bound) -> dict:
    shape = ctx.records[bound["probs"]].results[0].shape
    return {"factor": bound["factor"], "divide": bound["divide"], "batch": shape[0], "heads": shape[1],
            "fill": bound.get("fill", False), "export": ctx.needed_after(bound["probs"], bound["root"])}


def _lse_charge(node: str):
    """A flash kernel writes the row logsumexp of ``node``'s output, not the output itself."""
    def charges(ctx: Context, bound) -> list:
        if node not in bound["exported"]:
            return []
        return [(node, 0, _lse_bytes(ctx.records[bound[node]].results[0].shape))]
    return charges


# Attention written by hand, as matmul lowers it: bmm(q, k^T), times (or divided by) a
# scale, an optional additive or masked_fill(mask, -inf) mask, softmax over the last dim,
# bmm with v -> one kernel that scales, masks and normalizes the scores in place. In
# training the softmax output is kept for backward: the simulation writes it back too,
# and the cost counts the logsumexp a flash kernel writes instead (module docstring).
ATTENTION = Pattern(
    "attention",
    Op("aten::bmm", Op("aten::_softmax", _MASKED, Is(-1, 3), False, name="probs", view=True)),
    _attention_unmasked, "matmul", "q @ k^T * scale (+ mask), softmax, @ v -> one kernel, scores updated in place",
    inputs=(("scores", 0), ("scores", 1), ("root", 1), ("mask_add", 1), ("mask_fill", 1)),
    exports=("probs",), checks=(("mask_fill", 2, float("-inf")), ("scaled", 1, "factor")),
    guard=_attention_shapes, constants=_attention_constants, charges=_lse_charge("probs"),
)

# _log_softmax(x, d) -> nll_loss_forward(that, target), no class weights -> one pass over
# the logits. In training autograd keeps the log-probabilities: the simulation writes them
# back, the cost counts their logsumexp (module docstring).
CROSS_ENTROPY = Pattern(
    "cross_entropy",
    Op("aten::nll_loss_forward", Op("aten::_log_softmax", ANY, Arg("dim", _is_int), False, name="log_probs"),
       Arg("target", _is_tensor), None, Arg("reduction", _is_int), Arg("ignore_index", _is_int)),
    _cross_entropy, "reduction", "log_softmax, nll_loss -> one pass over the logits, their lse saved",
    inputs=(("log_probs", 0), ("root", 1)), outputs=(("root", 0), ("root", 1)), exports=("log_probs",),
    constants=lambda ctx, bound: {"dim": bound["dim"], "reduction": bound["reduction"],
                                  "ignore_index": bound["ignore_index"],
                                  "export": ctx.needed_after(bound["log_probs"], bound["root"])},
    charges=_lse_charge("log_probs"),
)

ATTENTION_BACKWARD = Custom(
    "attention_backward", match_attention_backward, "matmul",
    "dV, dP, softmax backward, scale, dQ, dK -> one flash backward", roots=("aten::bmm",),
)
