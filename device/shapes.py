"""Output metadata of an op without running it: shape inference on ``meta``, cached.

Entry points: :func:`infer` (run the op on meta tensors) and :data:`SHAPE_CACHE` (an
LRU keyed by the op and its arguments' metadata, built by the dispatcher).

Running an op on meta tensors costs ~100-200 us here, far more than everything else the
host does per op, so it runs once per op signature: the cached :class:`Inference` holds
the outputs' shapes, strides and dtypes and the op's cost from the cost model.

An op without a meta kernel cannot be queued (its output shape is unknown until it
runs): :data:`NO_META` marks it, and the dispatcher runs it through the CPU fallback. A
meta kernel that rejects the arguments does not decide alone: the dispatcher runs the op
on the CPU, so the user sees exactly the error the CPU gives, or the result if the meta
kernel was wrong.
"""
from __future__ import annotations

import collections
import itertools
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import _C as _native
from . import cost_model
from .index_checks import NeedsTheData, index_checked, index_put_checked, masked_scatter_checked
from .cpu_warnings import RESIZED_WARNING, CpuWarned, cpu_warnings, kept_warnings
from .storage import storage_nbytes

# An OrderedDict used as an LRU by the dispatcher (``get``, ``move_to_end``, ``popitem``:
# all C calls). A cachetools LRUCache costs three Python frames per hit, on every op.
SHAPE_CACHE: collections.OrderedDict = collections.OrderedDict()
SHAPE_CACHE_SIZE = 16384

NO_META = "no-meta"  # cached: this signature has no meta kernel
_SIGNATURE_IDS = itertools.count(1)


class MetaRejected(Exception):
    """The meta kernel raised for these arguments; ``error`` is what it raised."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class OutputSpec:
    """Metadata of one fresh output tensor."""

    __slots__ = ("shape", "stride", "dtype", "nbytes", "signature")

    def __init__(self, meta: torch.Tensor) -> None:
        if meta.layout != torch.strided:
            raise NotImplementedError(f"{meta.layout} tensors are not supported on the neuron device")
        self.shape = tuple(meta.shape)
        self.stride = tuple(meta.stride())
        self.dtype = meta.dtype
        self.nbytes = storage_nbytes(self.shape, self.stride, meta.element_size())
        self.signature = (self.shape, self.stride, self.dtype)


class Inference:
    """Cached result of shape inference for one op signature.

    ``outputs`` holds one :class:`OutputSpec` per returned tensor (None for a returned
    None); ``structure`` is "tensor", "tuple", "list" or "none" (how the op returns them).
    """

    __slots__ = ("outputs", "structure", "cost", "resized", "warnings", "resize_warns", "signature_id", "signature")

    def __init__(self, outputs, structure, cost, resized=(), warnings=(), resize_warns=True) -> None:
        self.signature_id = next(_SIGNATURE_IDS)  # a small, never reused number for this signature
        self.signature = None  # the signature itself (set by the dispatcher)
        self.outputs = outputs
        self.structure = structure
        self.cost = cost
        # ``out=`` arguments the op resizes: ((index, name, OutputSpec), ...)
        self.resized = resized
        # the CPU's warnings for these arguments, given at each call: ((message, category), ...)
        self.warnings = warnings
        # whether a resized out= tensor with elements gets ATen's resize warning
        self.resize_warns = resize_warns


def _probe_on_cpu(op, meta_args, meta_kwargs, increasing=()):
    """Output metadata as the CPU kernel gives it: run the op once on zero-filled CPU
    tensors of the same shapes (only for ops whose output metadata does not depend on the
    data, and zeros are valid inputs: indices, offsets and statistics alike). Tensors at
    the ``increasing`` argument positions hold 0, 1, 2... instead (bin edges)."""

    def cpu(value, fill):
        if isinstance(value, torch.Tensor):
            return fill(value)
        if isinstance(value, (list, tuple)):
            return type(value)(cpu(v, fill) for v in value)
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value

    def ascending(value):
        return torch.arange(value.numel(), device="cpu").to(value.dtype).reshape(value.shape)

    def zeros(value):  # with the argument's strides (a slice's too: they decide the output's)
        extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride())) if value.numel() else 0
        return torch.zeros(extent, dtype=value.dtype).as_strided(value.shape, value.stride())

    args = [cpu(v, ascending if i in increasing else zeros) for i, v in enumerate(meta_args)]
    result = op(*args, **{k: cpu(v, zeros) for k, v in meta_kwargs.items()})
    # the CPU's strides exactly (``.to("meta")`` would remake a size-1 dimension's)
    if isinstance(result, torch.Tensor):
        return _to_meta(result)
    return type(result)(_to_meta(r) if isinstance(r, torch.Tensor) else r for r in result)


_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _probe_reduced_precision(op, meta_args, meta_kwargs):
    """A CPU probe for bfloat16/float16 inputs, the meta kernel otherwise: ops whose
    meta kernel follows CUDA (float32 statistics) where the CPU returns statistics in the
    input's dtype."""
    first = meta_args[0] if meta_args else None
    if isinstance(first, torch.Tensor) and first.dtype in _REDUCED_PRECISION:
        return _probe_on_cpu(op, meta_args, meta_kwargs)
    return op(*meta_args, **meta_kwargs)


_aten = torch.ops.aten
# Ops whose meta kernel disagrees with the CPU kernel on output metadata (found by the
# OpInfo sweep, bench/op_coverage.py). Their shapes come from a CPU probe instead:
# - batch norm in eval mode: the CPU returns empty save_mean/save_invstd;
# - embedding_bag: offset2bag and max_indices depend on the mode differently;
# - ops PyTorch has no meta kernel for, whose output metadata does not depend on the data
#   (zeros are valid inputs): without one they would run on the CPU fallback, a sync
#   point. The backward kernels of multi_margin_loss, multilabel_margin_loss,
#   fractional_max_pool3d and ctc_loss (a training step would sync at each); histogram
#   and histogramdd. (geqrf stays on the fallback: the tests' example of an op the
#   device lacks.)
# - layer norm and batch norm on bfloat16/float16: the CPU returns the mean and inverse
#   standard deviation (and batch norm's new running statistics) in the input's dtype,
#   the meta kernels in float32 as CUDA does.
# - _grouped_mm (mixture-of-experts layers in transformers): its meta kernel accepts
#   only bfloat16, as CUDA's kernel; the CPU kernel takes float32 too (the Hugging Face
#   sweep, bench/hf_models.py: 56 MoE architectures fell back on it).
META_OVERRIDES = {
    op: _probe_on_cpu
    for op in (
        _aten.native_batch_norm.default,
        _aten._native_batch_norm_legit.default,
        _aten._native_batch_norm_legit.no_stats,
        _aten._native_batch_norm_legit_no_training.default,
        _aten._embedding_bag.default,
        _aten._embedding_bag_forward_only.default,
        _aten.multi_margin_loss.default,  # 1-D input, reduction="none": the meta kernel says (1,), the CPU ()
        _aten.multi_margin_loss_backward.default,
        _aten.multilabel_margin_loss_backward.default,
        _aten.fractional_max_pool3d_backward.default,
        _aten._ctc_loss_backward.default,
        _aten._ctc_loss_backward.Tensor,
        _aten.histogram.bin_ct,
        _aten._histogramdd_bin_edges.default,
        _aten._histogramdd_from_bin_cts.default,
        _aten._grouped_mm.default,
    )
}


def _probe_in_training(op, meta_args, meta_kwargs):
    """oneDNN's LSTM layer (``mkldnn_rnn_layer``, device/rnn.py): its workspace has the
    size oneDNN asks for (the meta kernel says 0 elements), and exists only when autograd
    is on; the device worker runs kernels with autograd on, so the probe does too."""
    with torch.enable_grad():
        return _probe_on_cpu(op, meta_args, meta_kwargs)


def _probe_bin_edges(op, meta_args, meta_kwargs):
    """histogram with its bin edges given (argument 1): a probe whose edges increase."""
    return _probe_on_cpu(op, meta_args, meta_kwargs, increasing=(1,))


def _out_keeps_its_shape(op, meta_args, meta_kwargs):
    """arange/linspace/logspace with ``out=``: the CPU kernels resize ``out`` only when
    its number of elements is not the result's (a (2, 2) view takes 4 values in place,
    written through to its base), where the meta kernels resize it to 1-d whenever the
    shape differs. The meta run on an empty ``out`` gives the count (and the checks).
    When the count differs, the CPU kernel resizes ``out`` with ``resize_``, without
    ATen's resize warning, and warns as it will (arange: "The out tensor will be
    resized"): the CPU's warnings come with the result (:class:`CpuWarned`)."""
    out = meta_kwargs["out"]
    result = op(*meta_args, **dict(meta_kwargs, out=torch.empty(0, dtype=out.dtype, device="meta")))
    if out.numel() == result.numel():
        return out
    given = cpu_warnings(op, meta_args, meta_kwargs)
    return CpuWarned(op(*meta_args, **meta_kwargs), given)


def _like_first_input(op, meta_args, meta_kwargs):
    """Random ops with no meta kernel whose output is shaped like their first input: a
    CPU probe would draw from the CPU's generator on the host."""
    return torch.empty_like(meta_args[0])


META_OVERRIDES.update({
    overload: _out_keeps_its_shape
    for packet in (_aten.arange, _aten.linspace, _aten.logspace)
    for overload in (getattr(packet, name) for name in packet.overloads() if name.endswith("out"))
})
META_OVERRIDES[_aten.mkldnn_rnn_layer.default] = _probe_in_training
META_OVERRIDES.update({op: index_put_checked  # the CPU's value shape and dtype checks (index_checks.py)
                       for op in (_aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default)})
# one sample (input of 0 or 1 dims) with reduction "none": the CPU's loss is 0-d, the
# meta kernel's has shape (1,)
META_OVERRIDES[_aten.index.Tensor] = index_checked  # an index into an empty dimension (index_checks.py)
META_OVERRIDES[_aten.masked_scatter_.default] = masked_scatter_checked
META_OVERRIDES[_aten.multilabel_margin_loss_forward.default] = _probe_on_cpu
META_OVERRIDES[_aten.binomial.default] = _like_first_input
META_OVERRIDES[_aten._sample_dirichlet.default] = _like_first_input
META_OVERRIDES[_aten.histogram.bins_tensor] = _probe_bin_edges
META_OVERRIDES[_aten._histogramdd_from_bin_tensors.default] = _probe_bin_edges
META_OVERRIDES.update({
    op: _probe_reduced_precision
    for op in (
        _aten.native_layer_norm.default,
        _aten._batch_norm_with_update.default,
        _aten._batch_norm_with_update_functional.default,
        _aten._batch_norm_no_update.default,
        _aten._native_batch_norm_legit_functional.default,
    )
})


_INDEX_ARGUMENTS = {"index", "indices"}


def check_on_cpu(entry, meta_args, meta_kwargs) -> tuple:
    """Try the op on one-element CPU tensors of ones, of the arguments' ranks and dtypes
    (they broadcast with anything; zeros would divide by zero; an index is 0): the argument
    checks the meta kernel skips (an in-place cast the CPU refuses, ``uniform_(2, 1)``,
    softmax's dim) raise :class:`MetaRejected` as a rejection by the meta kernel does, so
    the dispatcher runs the op on the CPU, which raises its own error at the call. A
    sampler draws from a throwaway generator.

    Returns the warnings the CPU gave for these arguments (``random_(0, 2**60)`` on
    float32, a uint8 mask): ``((message, category), ...)``, which the recorder gives the
    user at each call with this signature (``recorder._forward_warnings``), as the CPU
    kernel would; the kernel itself runs on the device's worker, whose warnings reach no
    one. An ``out=`` tensor's resize warning is the recorder's own."""

    def empty(value, fill=torch.ones):
        if isinstance(value, torch.Tensor):
            return fill((1,) * value.dim(), dtype=value.dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(empty(v, fill) for v in value)
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value

    def fill_for(name):  # an index of one element must be 0 to be in range
        return torch.zeros if name in _INDEX_ARGUMENTS else torch.ones

    def trial(value, name):  # a factory's size: one element of that rank
        if name == "size" and isinstance(value, (list, tuple)):
            return [1] * len(value)
        return empty(value, fill_for(name))

    names = [argument.name for argument in entry.op._schema.arguments]
    args = [trial(value, name) for value, name in zip(meta_args, names)]
    kwargs = {k: trial(v, k) for k, v in meta_kwargs.items()}
    if entry.generator_arg is not None:
        kwargs[entry.generator_arg] = torch.Generator()
    try:
        with _disable_current_modes(), warnings.catch_warnings(record=True) as python_warnings:
            warnings.simplefilter("always")
            _, cpp_warnings = _native.call_recording(entry.op, *args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the CPU refuses these arguments
        raise MetaRejected(error) from error
    return kept_warnings(python_warnings, cpp_warnings)


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.Generator):
        return None
    return value


def _device_tensor_bytes(values, is_device):
    """Bytes of each device tensor in ``values``, in the order the dispatcher records them
    (arguments, then keyword arguments; lists in order)."""
    for value in values:
        if is_device(value):
            yield value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            yield from _device_tensor_bytes(value, is_device)


def infer(entry, args, kwargs, is_device=lambda value: False) -> Inference | str:
    """Shape inference for ``entry.op`` called on ``args``/``kwargs``; ``is_device`` tells
    device tensors apart (their bytes are kept per argument, for fusion's accounting)."""
    op = entry.op
    meta_args = _to_meta(args)
    meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if entry.generator_arg is not None:  # a rewritten overload may require it (rand_like.generator)
        meta_kwargs.setdefault(entry.generator_arg, None)
    for index, name in entry.mutated:
        # Meta kernels skip the CPU's internal-overlap check on written tensors (an
        # in-place op on an expanded tensor): let the CPU decide, and raise its error.
        target = meta_args[index] if index < len(meta_args) else meta_kwargs.get(name)
        if isinstance(target, torch.Tensor) and torch._debug_has_internal_overlap(target) == 1:
            raise MetaRejected(RuntimeError("written-to tensor has internal overlap"))
    try:
        with _disable_current_modes(), warnings.catch_warnings():
            # an out= tensor resized: the recorder warns at each call, as the CPU does, where
            # the meta kernel would warn on a cache miss only (recorder._resize_outputs)
            warnings.filterwarnings("ignore", message=RESIZED_WARNING)  # Python meta kernels'; C++ ones':
            override = META_OVERRIDES.get(op)
            result = (override(op, meta_args, meta_kwargs) if override
                      else _native.call_quietly(RESIZED_WARNING, op, *meta_args, **meta_kwargs))
    except NotImplementedError:
        return NO_META
    except NeedsTheData:
        raise
    except Exception as error:  # the meta kernel rejected these arguments
        if "meta" in str(error).lower() and "not implemented" in str(error).lower():
            return NO_META
        raise MetaRejected(error) from error
    resize_warns = True  # ATen's resize warning for an out= tensor with elements
    if isinstance(result, CpuWarned):  # the CPU kernel's own warnings instead
        result, given, resize_warns = result.result, result.warnings, False
    else:
        given = ()
    if entry.checked_on_cpu:
        given += check_on_cpu(entry, meta_args, meta_kwargs)

    if isinstance(result, torch.Tensor):
        structure, values = "tensor", (result,)
    elif result is None:
        structure, values = "none", ()
    elif isinstance(result, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in result):
        structure, values = ("list" if isinstance(result, list) else "tuple"), tuple(result)
    else:  # a host value: not an op the device can queue
        return NO_META
    if any(v is not None and v.layout != torch.strided for v in values):
        return NO_META  # a sparse result (``to_sparse``): the CPU makes it (device/sparse.py)
    aliases = entry.return_alias if structure == "tuple" else entry.return_alias * len(values)
    outputs = tuple(
        OutputSpec(v) if v is not None and (alias is None) else None
        for v, alias in zip(values, aliases or (None,) * len(values))
    )
    written = [v for v, spec in zip(values, outputs) if spec is not None]
    resized = []
    for index, name in entry.mutated:
        value = meta_args[index] if index < len(meta_args) else meta_kwargs.get(name)
        before = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor) and (value.shape != before.shape or value.stride() != before.stride()):
            if name == "self" and value.shape != before.shape:
                # An in-place op never resizes its input (``small.add_(large)``: the CPU
                # raises "output with shape [1, 3] doesn't match the broadcast shape");
                # the meta kernels' out= handling would resize it: the CPU decides.
                raise MetaRejected(RuntimeError(f"{entry.name} would resize its input"))
            resized.append((index, name, OutputSpec(value)))
        written.extend(t for t in _flatten([value]) if isinstance(t, torch.Tensor))
    if resized and torch.Tag.pointwise in op.tags:
        resized = _strides_as_the_cpu_resizes(op, args, kwargs, resized)
    mutated_values = [args[i] if i < len(args) else kwargs.get(name) for i, name in entry.mutated]
    cost = cost_model.op_cost(
        op,
        meta_args,
        meta_kwargs,
        written,
        read_bytes=_device_tensor_bytes(list(args) + list(kwargs.values()), is_device),
        write_bytes=_device_tensor_bytes(mutated_values, is_device),
        result_bytes=[0 if spec is None else _numel(spec.shape) * spec.dtype.itemsize for spec in outputs],
    )
    return Inference(outputs, structure, cost, tuple(resized), given, resize_warns)


def _strides_as_the_cpu_resizes(op, args, kwargs, resized):
    """A pointwise op's ``out=`` tensors of another shape: the CPU's TensorIterator gives
    a resized output the strides of its inputs' layout (``torch.add(x.permute(0, 2, 1),
    1, out=torch.empty(0))`` has the permuted strides), where the meta kernels resize it
    contiguous. A CPU probe (``_probe_on_cpu``, once per signature) gives the CPU's;
    where the probe fails (zeros it cannot take), the meta kernel's stand."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the probe's own (its out= resized), Python's and C++'s
            result = _native.call_quietly("", _probe_on_cpu, op, _to_meta(args),
                                          {k: _to_meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - the meta kernel already accepted these arguments
        return resized
    probed = [v for v in _flatten([result]) if isinstance(v, torch.Tensor)]
    if len(probed) != len(resized):
        return resized
    return tuple((index, name, OutputSpec(value)) for (index, name, _), value in zip(resized, probed))


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _flatten(values):
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flatten(v)
        else:
            yield v


# Ops whose meta kernel accepts arguments the CPU rejects for their dtypes (found by
# trying users' common dtype mistakes against the CPU: `model(x.double())`, a long
# matrix times a float one, float indices, int32 targets). On neuron these were
# deferred device errors; when the check below fails, the CPU probe decides instead:
# it raises the CPU's error at once (at the user's line, as on the CPU), or gives the
# metadata where the CPU accepts the mix (bfloat16 layer norm with float32 weights).
def _one_dtype(meta_args, meta_kwargs):
    dtypes = {v.dtype for v in itertools.chain(meta_args, meta_kwargs.values()) if isinstance(v, torch.Tensor)}
    return len(dtypes) <= 1


def _argument_dtype_in(index, allowed):
    return lambda meta_args, meta_kwargs: index >= len(meta_args) or meta_args[index].dtype in allowed


def _dtypes_checked_on_cpu(check, inner):
    def override(op, meta_args, meta_kwargs):
        if not check(meta_args, meta_kwargs):
            return _probe_on_cpu(op, meta_args, meta_kwargs)
        return inner(op, meta_args, meta_kwargs) if inner is not None else op(*meta_args, **meta_kwargs)

    return override


for _op, _check in (
    (_aten.mm.default, _one_dtype),
    (_aten.addmm.default, _one_dtype),
    (_aten.addbmm.default, _one_dtype),
    (_aten.mv.default, _one_dtype),
    (_aten.convolution.default, _one_dtype),
    (_aten.native_layer_norm.default, _one_dtype),
    (_aten.index_select.default, _argument_dtype_in(2, (torch.int64, torch.int32))),
    (_aten.nll_loss_forward.default, _argument_dtype_in(1, (torch.int64, torch.uint8))),
    (_aten.nll_loss2d_forward.default, _argument_dtype_in(1, (torch.int64, torch.uint8))),
    (_aten.complex.default, _one_dtype),  # real and imaginary parts of one dtype
    (_aten.polar.default, _one_dtype),  # absolute value and angle of one dtype
    (_aten.logcumsumexp.out, _one_dtype),  # out= of the input's dtype
):
    META_OVERRIDES[_op] = _dtypes_checked_on_cpu(_check, META_OVERRIDES.get(_op))
