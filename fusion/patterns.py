"""The pattern library: op chains users write by hand, run as one library kernel.

Entry points: :data:`PATTERNS` (the table), :data:`KINDS` (what each library kernel is
to the loop rules), :data:`BY_ROOT` (the table by the op a chain ends with) and
:func:`find_patterns` (window -> matches). What matchers ask of a
window, and what a match is, live in ``fusion/matching.py``; the pattern form and its
matcher in ``fusion/pattern_form.py``.

Each table entry is a :class:`~.pattern_form.Pattern`: a tree of op nodes rooted at the
last op of its chain, with captured arguments and constraints (Inductor's and tinygrad's
pattern matchers have the same form), the checks and constants the match carries, the
ATen kernel that replaces the chain, its kind and a one-line comment. Attention's
backward, whose chain is found through readers rather than producers, keeps its own
matcher (a :class:`~.pattern_form.Custom` entry). A match applies only when it is exactly
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
and outputs, with a row log-sum-exp written in place of the scores autograd keeps.
Implementations are TorchScript-able: the device runs each as one TorchScript function
(``fused_kernel.library_function``), which a native launch calls from C++.

Tolerances against the unfused ops, each checked by a test (``tests/fusion/test_patterns.py``):

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
from adaptive_eager_device.core.reasons import Refused
from adaptive_eager_device.hardware.plan import constants_hold
from adaptive_eager_device.memory.storage import DeviceStorage, ViewRef

from .flash import ATTENTION, ATTENTION_BACKWARD, CROSS_ENTROPY
from .matching import Context
from .pattern_form import ANY, Alt, Arg, Dim, Op, Pattern, Same, Seq

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_LAST = Dim(dims=(-1,))


def _is_float(value) -> bool:
    return isinstance(value, float)


def _shifted(name: str, readers: int) -> Op:
    """``x - amax(x, d, keepdim=True)``, the max-subtracted input, bound as ``name``."""
    peak = Op("aten::amax", Arg("x"), Dim("d"), True, name="peak")
    return Op("aten::sub", Arg("x"), peak, name=name, readers=readers)


def _dim(ctx, bound) -> dict:
    return {"dim": bound["d"]}


def _rms_norm_constants(ctx, bound) -> dict:
    cast = bound.get("cast")
    return {"eps": bound["eps"], "cast_dtype": ctx.records[cast].results[0].dtype if cast is not None else None,
            "exports": ",".join(bound["exported"])}


def _layer_norm_affine(ctx, bound) -> bool:
    """w and b: tensors of the normalized (last) dim's size."""
    shape = bound["x"].shape
    width = shape[-1] if shape else None
    return all(type(t) is DeviceStorage and t.shape == (width,) for t in (bound["weight"], bound["bias"]))


def _place(ref):
    """(storage, shape, stride, offset) of a tensor argument, or None."""
    if type(ref) is DeviceStorage:
        return ref, tuple(ref.shape), tuple(ref.stride), 0
    if type(ref) is ViewRef:
        return ref.storage, tuple(ref.shape), tuple(ref.stride), ref.offset
    return None


def _rotated_halves(ctx, bound) -> bool:
    """``cat`` over the last dim of ``-x[..., h:]`` and ``x[..., :h]``, h half of x's last dim."""
    joined = bound["joined"]
    if ctx.arg(joined, 1, 0) not in (-1, len(ctx.records[joined].results[0].shape) - 1):
        return False
    x = _place(ctx.arg(bound["direct"], 0))
    first, second = _place(ctx.arg(joined, 0)[1]), _place(ctx.arg(bound["negated"], 0))
    if x is None or first is None or second is None:
        return False
    storage, shape, stride, offset = x
    half = shape[-1] // 2 if shape else 0
    if not half or shape[-1] != 2 * half or stride[-1] != 1:
        return False
    halves = shape[:-1] + (half,)
    return first == (storage, halves, stride, offset) and second == (storage, halves, stride, offset + half)


# -- the library kernels: TorchScript-able, (*inputs, **constants) -> [outputs] ----------


def _softmax(x: torch.Tensor, dim: int) -> List[torch.Tensor]:
    return [torch.ops.aten._softmax(x, dim, False)]


def _log_softmax(x: torch.Tensor, dim: int) -> List[torch.Tensor]:
    return [torch.ops.aten._log_softmax(x, dim, False)]


def _silu(x: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.silu(x)]


def _gelu_tanh(x: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.gelu(x, approximate="tanh")]


def _gelu_erf(x: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.gelu(x)]


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


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> List[torch.Tensor]:
    return [torch.ops.aten.native_layer_norm(x, [x.size(-1)], weight, bias, eps)[0]]


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> List[torch.Tensor]:
    half = x.size(-1) // 2
    out = x * cos  # then the rotated half's terms, added in place
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return [out]


def _addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> List[torch.Tensor]:
    return [torch.ops.aten.addmm(bias, x, weight)]


# -- the chains -------------------------------------------------------------------------


_RMS_NORMED = Op(  # x * rsqrt(mean(x**2, -1, keepdim) + eps)
    "aten::mul", Arg("x"),
    Op("aten::rsqrt", Op("aten::add", Op("aten::mean", Op("aten::pow", Arg("x"), 2, name="square"), _LAST, True,
                                         name="mean"), Arg("eps", _is_float), name="plus_eps"), name="rstd"),
    name="normed",
)
_ERF_SCALED = Alt(  # x / sqrt(2), or x * (1 / sqrt(2))
    Op("aten::div", Arg("x"), ANY, name="scaled", let={"factor": math.sqrt(2.0)}),
    Op("aten::mul", Arg("x"), ANY, name="scaled", let={"factor": 1.0 / math.sqrt(2.0)}),
)
_TANH_INNER = Op(  # x + 0.044715 * x**3, the constants checked
    "aten::add", Arg("x"), Op("aten::mul", Op("aten::pow", Arg("x"), ANY, name="power"), ANY, name="cubic"),
    name="inner",
)
_CENTERED = Op("aten::sub", Arg("x"), Op("aten::mean", Arg("x"), _LAST, True, name="mean"), name="centered")
_STD = Op(  # sqrt(var(x, -1, correction=0, keepdim) + eps)
    "aten::sqrt",
    Op("aten::add", Op("aten::var", Arg("x"), _LAST, kwargs={"correction": 0, "keepdim": True}, name="var"),
       Arg("eps", _is_float), name="plus_eps"),
    name="denominator",
)
_ROTATED = Op(  # cat((-x2, x1), -1) * sin
    "aten::mul", Op("aten::cat", Seq(Op("aten::neg", name="negated"), ANY), name="joined"), ANY, name="rotated",
)


# The table, tried in this order at each root from the window's end.
PATTERNS = [
    ATTENTION,
    ATTENTION_BACKWARD,
    Pattern(
        "rotary", Op("aten::add", Op("aten::mul", name="direct"), _ROTATED, kwargs={"alpha": 1}), _rotary, None,
        "x * cos + cat(-x2, x1) * sin: rotary embedding without the rotated copy",
        inputs=(("direct", 0), ("direct", 1), ("rotated", 1)), guard=_rotated_halves,
    ),
    Pattern(
        "softmax",
        Op("aten::div", Op("aten::exp", _shifted("shifted", 1), name="exp", readers=2),
           Op("aten::sum", Same("exp"), Dim("d"), True, name="total")),
        _softmax, "reduction", "exp(x - amax) / sum(exp): the max-subtracted softmax, one kernel",
        inputs=(("peak", 0),), constants=_dim,
    ),
    Pattern(
        "log_softmax",
        Op("aten::sub", _shifted("shifted", 2),
           Op("aten::log", Op("aten::sum", Op("aten::exp", Same("shifted"), name="exp"), Dim("d"), True, name="total"),
              name="log")),
        _log_softmax, "reduction", "x - amax - log(sum(exp)): log-softmax, one kernel",
        inputs=(("peak", 0),), constants=_dim,
    ),
    Pattern(
        "gelu_tanh",
        Op("aten::mul", Op("aten::mul", Arg("x"), ANY, name="half_x"),
           Op("aten::add", Op("aten::tanh", Op("aten::mul", _TANH_INNER, ANY, name="scaled"), name="tanh"), ANY,
              name="one_plus")),
        _gelu_tanh, None, "GPT-2's tanh GELU formula -> gelu(approximate='tanh')",
        inputs=(("half_x", 0),),
        checks=(("half_x", 1, 0.5), ("power", 1, 3.0), ("cubic", 1, 0.044715), ("scaled", 1, _SQRT_2_OVER_PI),
                ("one_plus", 1, 1.0)),
    ),
    Pattern(
        "gelu_erf",
        Op("aten::mul", Op("aten::mul", Arg("x"), ANY, name="half_x"),
           Op("aten::add", Op("aten::erf", _ERF_SCALED, name="erf"), ANY, name="one_plus")),
        _gelu_erf, None, "x * 0.5 * (1 + erf(x / sqrt(2))) -> gelu",
        inputs=(("half_x", 0),), checks=(("half_x", 1, 0.5), ("scaled", 1, "factor"), ("one_plus", 1, 1.0)),
    ),
    Pattern(
        "silu",
        Alt(Op("aten::mul", Arg("x"), Op("aten::sigmoid", Arg("x"), name="gate")),
            Op("aten::mul", Op("aten::sigmoid", Arg("x"), name="gate"), Arg("x"))),
        _silu, None, "x * sigmoid(x) -> silu", inputs=(("gate", 0),),
    ),
    Pattern(  # in training autograd keeps rsqrt(...) and the normalized x: exports
        "rms_norm", Op("aten::mul", ANY, Alt(Op("aten::_to_copy", _RMS_NORMED, name="cast"), _RMS_NORMED)),
        _rms_norm, "reduction", "Llama's RMSNorm, float32 compute and cast back, times weight",
        inputs=(("square", 0), ("root", 0)), exports=("rstd", "normed", "cast"), checks=(("plus_eps", 1, "eps"),),
        constants=_rms_norm_constants,
    ),
    Pattern(
        "layer_norm",
        Op("aten::add", Op("aten::mul", Op("aten::div", _CENTERED, _STD, name="normed"), Arg("weight"), name="scaled"),
           Arg("bias")),
        _layer_norm, "reduction", "(x - mean) / sqrt(var + eps) * w + b -> one normalization",
        inputs=(("mean", 0), ("scaled", 1), ("root", 1)), checks=(("plus_eps", 1, "eps"),),
        guard=_layer_norm_affine, constants=lambda ctx, bound: {"eps": bound["eps"]},
    ),
    Pattern(
        "linear_bias",
        Op("aten::add", Op("aten::mm", name="product"),
           Arg("bias", lambda ref: type(ref) is DeviceStorage and len(ref.shape) == 1), kwargs={"alpha": 1}),
        _addmm, "matmul", "mm + bias add -> addmm", inputs=(("root", 1), ("product", 0), ("product", 1)),
    ),
    CROSS_ENTROPY,
]

# What each library kernel is to the loop rules: a matmul (takes an epilogue, no
# prologue), a reduction (prologue and epilogue over its input's or output's elements),
# or pointwise (None). A kernel absent from this table fuses with nothing.
KINDS = {entry.name: entry.kind for entry in PATTERNS}



def _by_root(table) -> dict:
    """The entries by the op their chain ends with, in table order (as tinygrad's
    PatternMatcher indexes its patterns by op): a root is tried against these alone."""
    by_root: dict = {}
    for entry in table:
        for op in entry.roots:
            by_root.setdefault(op, []).append(entry)
    return by_root


BY_ROOT = _by_root(PATTERNS)


def find_patterns(graph) -> tuple[list, dict]:
    """Matches in the window (its ``WindowGraph``: disjoint, from the last op backwards)
    and refusal reasons."""
    ctx = Context(graph)
    records = ctx.records
    matches, refusals = [], {}
    for root in range(len(records) - 1, -1, -1):
        if root in ctx.claimed:
            continue
        for entry in BY_ROOT.get(ctx.name(root), ()):
            name = entry.name
            found = entry.match(ctx, root)
            if found is None:
                continue
            if isinstance(found, str):
                reason = Refused.PATTERN.of(f"{name}, {found}")
                refusals[reason] = refusals.get(reason, 0) + 1
                continue
            if ctx.claimed.intersection(found.members):
                continue
            if found.checks and not constants_hold(found.checks, records):
                reason = Refused.PATTERN.of(f"{name}, other constants")
                refusals[reason] = refusals.get(reason, 0) + 1
                continue
            ctx.claimed.update(found.members)
            matches.append(found)
            break
    return matches, refusals
