"""The pattern library: op chains users write by hand, run as one library kernel.

Entry points: :data:`PATTERNS` (the table) and :func:`find_patterns` (window -> matches).
What matchers ask of a window, and what a match is, live in ``fusion/matching.py``.

Each table entry is a matcher, rooted at the last op of its chain, with the ATen kernel
that replaces the chain and a one-line comment. A match applies only when it is exactly
right: every intermediate of the chain is produced and read inside it, read by the chain
alone, never written in place, never viewed, and not referenced from Python at the
flush. The one exception is an *export*: an intermediate the library kernel also
computes (RMSNorm's ``rsqrt(...)`` and normalized input, attention's softmax output) may
be needed after the chain, as autograd keeps it for backward; the kernel then writes it
back too. Scalar constants a chain depends on (``eps``, GELU's 0.044715, the attention
scale) are checked again at every launch, since plan-cache keys hold float types, not
values; a launch whose constants differ runs the chain op by op.

A matched chain is one unit of its kernel: alone, or inside a larger kernel when the
on-chip rule merges it with its neighbours. Attention and cross-entropy
(``fusion/flash.py``) are modelled as SBUF-tiled kernels: their traffic is their inputs
and outputs, with a row log-sum-exp written in place of the scores autograd keeps. Implementations are TorchScript-able, so a
hot kernel holding one is built (``device/built_kernel.py``) like any other.

Tolerances against the unfused ops, each checked by a test (``tests/test_patterns.py``):

- softmax, log_softmax: 1e-6 relative (ATen's kernels subtract the max the same way);
- GELU, SiLU: 1e-6 (one fused expression instead of rounding after each op);
- RMSNorm, layer norm: 1e-5 (the variance is accumulated in one pass);
- linear + bias: 1e-6 (addmm adds the bias inside the GEMM);
- attention: exact (the same ops, with the scores scaled, masked and normalized in place);
- cross-entropy: exact (the same two ops);
- rotary: 1e-6 (the rotated half is added with addcmul, one rounding less).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from adaptive_eager_device.reasons import Refused
from adaptive_eager_device.storage import DeviceStorage, ViewRef

from .flash import match_attention, match_attention_backward, match_cross_entropy
from .matching import Context, Match, checks_pass, dims_of


# -- matchers ---------------------------------------------------------------------------


def _max_shifted(ctx: Context, shifted: int, dims) -> int | None:
    """Position of ``amax(x, dims, keepdim=True)`` when ``shifted`` is ``x - that``."""
    peak = ctx.source(shifted, 1, "aten::amax")
    if peak is None or not ctx.same(shifted, 0, peak, 0) or dims_of(ctx.arg(peak, 1)) != dims:
        return None
    return peak if ctx.arg(peak, 2) is True else None


def match_softmax(ctx: Context, root: int):
    """exp(x - amax(x, d, keepdim)) / sum(that, d, keepdim) -> _softmax(x, d)."""
    if ctx.name(root) != "aten::div":
        return None
    exp = ctx.source(root, 0, "aten::exp")
    total = ctx.source(root, 1, "aten::sum")
    if exp is None or total is None or ctx.source(total, 0) != exp:
        return None
    shifted = ctx.source(exp, 0, "aten::sub")
    dims = dims_of(ctx.arg(total, 1))
    if shifted is None or dims is None or len(dims) != 1 or ctx.arg(total, 2) is not True:
        return None
    peak = _max_shifted(ctx, shifted, dims)
    if peak is None:
        return None
    if not (ctx.private(exp, 2) and ctx.private(total, 1) and ctx.private(shifted, 1) and ctx.private(peak, 1)):
        return "intermediate escapes or is shared"
    return Match("softmax", [peak, shifted, exp, total, root], _softmax, [(peak, 0)], [(root, 0)], constants={"dim": dims[0]})


def _softmax(x: torch.Tensor, dim: int) -> List[torch.Tensor]:
    return [torch.ops.aten._softmax(x, dim, False)]


def match_log_softmax(ctx: Context, root: int):
    """(x - amax) - log(sum(exp(x - amax), d, keepdim)) -> _log_softmax(x, d)."""
    if ctx.name(root) != "aten::sub":
        return None
    shifted = ctx.source(root, 0, "aten::sub")
    log = ctx.source(root, 1, "aten::log")
    if shifted is None or log is None:
        return None
    total = ctx.source(log, 0, "aten::sum")
    exp = ctx.source(total, 0, "aten::exp") if total is not None else None
    if exp is None or ctx.source(exp, 0) != shifted:
        return None
    dims = dims_of(ctx.arg(total, 1))
    if dims is None or len(dims) != 1 or ctx.arg(total, 2) is not True:
        return None
    peak = _max_shifted(ctx, shifted, dims)
    if peak is None:
        return None
    if not all(ctx.private(p, n) for p, n in ((shifted, 2), (exp, 1), (total, 1), (log, 1), (peak, 1))):
        return "intermediate escapes or is shared"
    return Match("log_softmax", [peak, shifted, exp, total, log, root], _log_softmax, [(peak, 0)], [(root, 0)],
                 constants={"dim": dims[0]})


def _log_softmax(x: torch.Tensor, dim: int) -> List[torch.Tensor]:
    return [torch.ops.aten._log_softmax(x, dim, False)]


def match_silu(ctx: Context, root: int):
    """x * sigmoid(x) -> silu(x)."""
    if ctx.name(root) != "aten::mul":
        return None
    for gate_arg, other_arg in ((1, 0), (0, 1)):
        gate = ctx.source(root, gate_arg, "aten::sigmoid")
        if gate is not None and ctx.same(gate, 0, root, other_arg):
            if not ctx.private(gate, 1):
                return "intermediate escapes or is shared"
            return Match("silu", [gate, root], _silu, [(gate, 0)], [(root, 0)])
    return None


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def match_gelu_tanh(ctx: Context, root: int):
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) -> gelu(x, 'tanh')."""
    if ctx.name(root) != "aten::mul":
        return None
    one_plus = ctx.source(root, 1, "aten::add")
    half_x = ctx.source(root, 0, "aten::mul")
    if one_plus is None or half_x is None:
        return None
    tanh = ctx.source(one_plus, 0, "aten::tanh")
    scaled = ctx.source(tanh, 0, "aten::mul") if tanh is not None else None
    inner = ctx.source(scaled, 0, "aten::add") if scaled is not None else None
    cubic = ctx.source(inner, 1, "aten::mul") if inner is not None else None
    power = ctx.source(cubic, 0, "aten::pow") if cubic is not None else None
    if power is None:
        return None
    if not (ctx.same(inner, 0, half_x, 0) and ctx.same(power, 0, half_x, 0)):
        return None
    chain = [half_x, power, cubic, inner, scaled, tanh, one_plus]
    if not all(ctx.private(p, 1) for p in chain):
        return "intermediate escapes or is shared"
    checks = [(half_x, 1, 0.5), (power, 1, 3.0), (cubic, 1, 0.044715), (scaled, 1, _SQRT_2_OVER_PI), (one_plus, 1, 1.0)]
    return Match("gelu_tanh", chain + [root], _gelu_tanh, [(half_x, 0)], [(root, 0)], checks)


def _silu(x: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.silu(x)]


def _gelu_tanh(x: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.gelu(x, approximate="tanh")]


def _gelu_erf(x: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.gelu(x)]


def match_gelu_erf(ctx: Context, root: int):
    """x * 0.5 * (1 + erf(x / sqrt(2))) -> gelu(x)."""
    if ctx.name(root) != "aten::mul":
        return None
    one_plus = ctx.source(root, 1, "aten::add")
    half_x = ctx.source(root, 0, "aten::mul")
    if one_plus is None or half_x is None:
        return None
    erf = ctx.source(one_plus, 0, "aten::erf")
    scaled = ctx.source(erf, 0) if erf is not None else None
    if scaled is None or ctx.name(scaled) not in ("aten::div", "aten::mul"):
        return None
    if not ctx.same(scaled, 0, half_x, 0):
        return None
    if not all(ctx.private(p, 1) for p in (half_x, scaled, erf, one_plus)):
        return "intermediate escapes or is shared"
    factor = math.sqrt(2.0) if ctx.name(scaled) == "aten::div" else 1.0 / math.sqrt(2.0)
    checks = [(half_x, 1, 0.5), (scaled, 1, factor), (one_plus, 1, 1.0)]
    return Match("gelu_erf", [half_x, scaled, erf, one_plus, root], _gelu_erf, [(half_x, 0)], [(root, 0)], checks)


def match_rms_norm(ctx: Context, root: int):
    """Hugging Face's LlamaRMSNorm: w * (x * rsqrt(mean(x**2, -1, keepdim) + eps)).to(dtype),
    x cast to float32 first -> one kernel. In training, autograd keeps ``rsqrt(...)`` and
    the normalized ``x * rsqrt(...)``: the kernel writes them back too (exports)."""
    if ctx.name(root) != "aten::mul":
        return None
    normed = ctx.source(root, 1)
    if normed is None:
        return None
    cast_back = None
    if ctx.name(normed) == "aten::_to_copy":
        cast_back, normed = normed, ctx.source(normed, 0, "aten::mul")
        if normed is None:
            return None
    if ctx.name(normed) != "aten::mul":
        return None
    rsqrt = ctx.source(normed, 1, "aten::rsqrt")
    plus_eps = ctx.source(rsqrt, 0, "aten::add") if rsqrt is not None else None
    mean = ctx.source(plus_eps, 0, "aten::mean") if plus_eps is not None else None
    square = ctx.source(mean, 0, "aten::pow") if mean is not None else None
    if square is None or ctx.arg(square, 1) != 2 or not ctx.same(square, 0, normed, 0):
        return None
    if dims_of(ctx.arg(mean, 1)) not in ((-1,),) or ctx.arg(mean, 2) is not True:
        return None
    eps = ctx.arg(plus_eps, 1)
    if not isinstance(eps, float):
        return None
    kept = [("rstd", rsqrt), ("normed", normed)] + ([("cast", cast_back)] if cast_back is not None else [])
    if not (all(ctx.private(p, 1) for p in (square, mean, plus_eps)) and all(ctx.exportable(p, 1, root) for _, p in kept)):
        return "intermediate escapes or is shared"
    exports = [(name, position) for name, position in kept if ctx.needed_after(position, root)]
    chain = [square, mean, plus_eps, rsqrt, normed] + ([cast_back] if cast_back is not None else [])
    cast_dtype = ctx.records[cast_back].results[0].dtype if cast_back is not None else None
    return Match(
        "rms_norm", chain + [root], _rms_norm, [(square, 0), (root, 0)],
        [(root, 0)] + [(position, 0) for _, position in exports],
        checks=[(plus_eps, 1, eps)],
        constants={"eps": eps, "cast_dtype": cast_dtype, "exports": ",".join(name for name, _ in exports)},
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_dtype: Optional[int], exports: str) -> List[torch.Tensor]:
    normed, rstd = torch.ops.aten._fused_rms_norm(x, [x.size(-1)], None, eps)
    cast = normed if cast_dtype is None else normed.to(cast_dtype)
    values = [weight * cast]
    for name in exports.split(","):
        if name == "rstd":
            values.append(rstd)
        elif name == "normed":
            values.append(normed)
        elif name == "cast":
            values.append(cast)
    return values


def match_layer_norm(ctx: Context, root: int):
    """(x - mean) / sqrt(var(unbiased=False) + eps) * w + b, written out, w and b of the
    last dim's size -> native_layer_norm."""
    if ctx.name(root) != "aten::add":
        return None
    scaled = ctx.source(root, 0, "aten::mul")
    normed = ctx.source(scaled, 0, "aten::div") if scaled is not None else None
    if normed is None:
        return None
    centered = ctx.source(normed, 0, "aten::sub")
    denominator = ctx.source(normed, 1, "aten::sqrt")
    plus_eps = ctx.source(denominator, 0, "aten::add") if denominator is not None else None
    var = ctx.source(plus_eps, 0, "aten::var") if plus_eps is not None else None
    mean = ctx.source(centered, 1, "aten::mean") if centered is not None else None
    if var is None or mean is None or not (ctx.same(centered, 0, mean, 0) and ctx.same(var, 0, mean, 0)):
        return None
    if dims_of(ctx.arg(mean, 1)) != (-1,) or ctx.arg(mean, 2) is not True or dims_of(ctx.arg(var, 1)) != (-1,):
        return None
    var_kwargs = ctx.records[var].kwargs
    if var_kwargs.get("correction") != 0 or var_kwargs.get("keepdim") is not True:
        return None
    x = ctx.arg(mean, 0)
    width = x.shape[-1] if x.shape else None
    weight, bias = ctx.arg(scaled, 1), ctx.arg(root, 1)
    if not all(type(t) is DeviceStorage and t.shape == (width,) for t in (weight, bias)):
        return None
    eps = ctx.arg(plus_eps, 1)
    if not isinstance(eps, float):
        return None
    chain = [mean, centered, var, plus_eps, denominator, normed, scaled]
    if not (ctx.private(centered, 1) and ctx.private(mean, 1) and all(ctx.private(p, 1) for p in chain[2:])):
        return "intermediate escapes or is shared"
    return Match(
        "layer_norm", chain + [root], _layer_norm, [(mean, 0), (scaled, 1), (root, 1)], [(root, 0)],
        checks=[(plus_eps, 1, eps)], constants={"eps": eps},
    )


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> List[torch.Tensor]:
    return [torch.ops.aten.native_layer_norm(x, [x.size(-1)], weight, bias, eps)[0]]


def match_linear_bias(ctx: Context, root: int):
    """mm(x, w) + b (b broadcast over rows) -> addmm(b, x, w)."""
    if ctx.name(root) != "aten::add" or ctx.records[root].kwargs.get("alpha", 1) != 1:
        return None
    product = ctx.source(root, 0, "aten::mm")
    if product is None:
        return None
    bias = ctx.arg(root, 1)
    if not (type(bias) is DeviceStorage and len(bias.shape) == 1):
        return None
    if not ctx.private(product, 1):
        return "intermediate escapes or is shared"
    return Match("linear_bias", [product, root], _addmm, [(root, 1), (product, 0), (product, 1)], [(root, 0)])


def _place(ref):
    """(storage, shape, stride, offset) of a tensor argument, or None."""
    if type(ref) is DeviceStorage:
        return ref, tuple(ref.shape), tuple(ref.stride), 0
    if type(ref) is ViewRef:
        return ref.storage, tuple(ref.shape), tuple(ref.stride), ref.offset
    return None


def match_rotary(ctx: Context, root: int):
    """Hugging Face's rotary embedding: x * cos + rotate_half(x) * sin, rotate_half(x) =
    cat((-x[..., h:], x[..., :h]), -1) -> one kernel with no rotated copy of x."""
    if ctx.name(root) != "aten::add" or ctx.records[root].kwargs.get("alpha", 1) != 1:
        return None
    direct = ctx.source(root, 0, "aten::mul")
    rotated = ctx.source(root, 1, "aten::mul")
    if direct is None or rotated is None:
        return None
    joined = ctx.source(rotated, 0, "aten::cat")
    if joined is None or ctx.arg(joined, 1, 0) not in (-1, len(ctx.records[joined].results[0].shape) - 1):
        return None
    parts = ctx.arg(joined, 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or type(parts[0]) is not DeviceStorage:
        return None
    negated = ctx.producer_of(parts[0], "aten::neg")
    if negated is None:
        return None
    x, first, second = _place(ctx.arg(direct, 0)), _place(parts[1]), _place(ctx.arg(negated, 0))
    if x is None or first is None or second is None:
        return None
    storage, shape, stride, offset = x
    half = shape[-1] // 2 if shape else 0
    if not half or shape[-1] != 2 * half or stride[-1] != 1:
        return None
    halves = shape[:-1] + (half,)
    if first != (storage, halves, stride, offset) or second != (storage, halves, stride, offset + half):
        return None
    if not all(ctx.private(p, 1) for p in (direct, negated, joined, rotated)):
        return "intermediate escapes or is shared"
    return Match("rotary", [direct, negated, joined, rotated, root], _rotary,
                 [(direct, 0), (direct, 1), (rotated, 1)], [(root, 0)])


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> List[torch.Tensor]:
    half = x.size(-1) // 2
    out = x * cos  # then the rotated half's terms, added in place
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return [out]


def _addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.addmm(bias, x, weight)]


# (pattern name, matcher, one-line comment): the table, tried from each window's end.
PATTERNS = [
    ("attention", match_attention, "q @ k^T * scale (+ mask), softmax, @ v -> one kernel, scores updated in place"),
    ("attention_backward", match_attention_backward, "dV, dP, softmax backward, scale, dQ, dK -> one flash backward"),
    ("rotary", match_rotary, "x * cos + cat(-x2, x1) * sin: rotary embedding without the rotated copy"),
    ("softmax", match_softmax, "exp(x - amax) / sum(exp): the max-subtracted softmax, one kernel"),
    ("log_softmax", match_log_softmax, "x - amax - log(sum(exp)): log-softmax, one kernel"),
    ("gelu_tanh", match_gelu_tanh, "GPT-2's tanh GELU formula -> gelu(approximate='tanh')"),
    ("gelu_erf", match_gelu_erf, "x * 0.5 * (1 + erf(x / sqrt(2))) -> gelu"),
    ("silu", match_silu, "x * sigmoid(x) -> silu"),
    ("rms_norm", match_rms_norm, "Llama's RMSNorm, float32 compute and cast back, times weight"),
    ("layer_norm", match_layer_norm, "(x - mean) / sqrt(var + eps) * w + b -> one normalization"),
    ("linear_bias", match_linear_bias, "mm + bias add -> addmm"),
    ("cross_entropy", match_cross_entropy, "log_softmax, nll_loss -> one pass over the logits, their lse saved"),
]


# What each library kernel is to the loop rules: a matmul (takes an epilogue, no
# prologue), a reduction (prologue and epilogue over its input's or output's elements),
# or pointwise (None). A kernel absent from this table fuses with nothing.
KINDS = {
    "attention": "matmul", "attention_backward": "matmul", "linear_bias": "matmul",
    "softmax": "reduction", "log_softmax": "reduction", "rms_norm": "reduction", "layer_norm": "reduction",
    "cross_entropy": "reduction", "gelu_tanh": None, "gelu_erf": None, "silu": None, "rotary": None,
}


def find_patterns(records, escapes) -> tuple[list, dict]:
    """Matches in the window (disjoint, from the last op backwards) and refusal reasons."""
    ctx = Context(records, escapes)
    matches, refusals = [], {}
    for root in range(len(records) - 1, -1, -1):
        if root in ctx.claimed:
            continue
        for name, matcher, _ in PATTERNS:
            found = matcher(ctx, root)
            if found is None:
                continue
            if isinstance(found, str):
                reason = Refused.PATTERN.of(f"{name}, {found}")
                refusals[reason] = refusals.get(reason, 0) + 1
                continue
            if ctx.claimed.intersection(found.members):
                continue
            if found.checks and not checks_pass(found.checks, records):
                reason = Refused.PATTERN.of(f"{name}, other constants")
                refusals[reason] = refusals.get(reason, 0) + 1
                continue
            ctx.claimed.update(found.members)
            matches.append(found)
            break
    return matches, refusals
