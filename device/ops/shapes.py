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

from .. import _C as _native
from ..core.errors import QUANTIZED_DTYPES, quantized_refusal, users_error
from ..hardware import cost_model
from ..memory.storage import storage_nbytes
from .cpu_warnings import RESIZED_WARNING, CpuWarned, warnings_of_call
from .index_checks import NeedsTheData
from .meta_overrides import META_OVERRIDES, probe_on_cpu, to_meta

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


# Tensor arguments whose values are positions (an index, a bag's offsets, a class
# target): a trial fills them with 0, which is in range of any non-empty dimension.
_INDEX_ARGUMENTS = {"index", "indices", "offsets", "target"}

# The most bytes a full-shape trial (:func:`trial_at_the_shapes`) allocates; above it the
# CPU is not asked, and an error of the kernel stays deferred to the next sync point. An
# assumption: the trial runs once per signature, only after the one-element trial failed,
# and this bounds its host memory and time (64 MiB of ones: about 10 ms to fill).
FULL_TRIAL_BYTES = 8 << 20

# Ops the CPU's trial skips: backward kernels, which trust what their forward saved
# (``_ctc_loss_backward`` indexes its ``log_alpha`` by the lengths: fed trial values it
# reads and writes out of bounds), and random ops (the trial would draw from the CPU's
# generator). Autograd gives a backward kernel the arguments its forward checked.
def tried_on_cpu(entry) -> bool:
    name = entry.name
    return (entry.kind == "kernel" and not entry.checked_on_cpu and not entry.random
            and name.startswith("aten::") and "backward" not in name)


def _validates_its_arguments(name: str) -> bool:
    """Whether the CPU kernel of ``name`` checks its arguments against each other, so a
    trial on one-element tensors (whatever the sizes its int arguments give) is refused
    rather than read out of bounds: public ATen ops, which users call directly. Private
    ops (``_embedding_bag``) and library kernels (``mkldnn_rnn_layer`` sizes its buffers
    from ``hidden_size``) are tried at their arguments' own shapes only."""
    base = name.partition("::")[2]
    return not base.startswith(("_", "mkldnn", "miopen", "cudnn", "fbgemm", "quantized"))


class TrialRefused(MetaRejected):
    """The meta kernel accepted the arguments, but the CPU kernel refused the trial at
    the arguments' own shapes, dtypes, strides and scalars (filled with ones; positions
    with 0): the dispatcher runs this call on the host, on its data, so the CPU decides
    (``recorder._decided_on_the_host``). ``inference`` is the signature's metadata, cached
    when the CPU accepts the real data (the trial's values were refused, not the
    signature). ``host_visible``: a fill of zeros is refused with the same type and
    message, so no value decides the refusal; the signature is then cached as raising
    (:class:`Refused`) if the host run raises that same error too."""

    def __init__(self, error: BaseException, inference, host_visible: bool) -> None:
        super().__init__(error)
        self.inference = inference
        self.host_visible = host_visible


class Refused:
    """A signature the CPU refuses whatever the data (shape-cache value): each call with
    it raises the CPU's error at the call, without running anything. Kept: the error's
    type and message, checked equal across a trial of ones, one of zeros and the user's
    own data (:class:`TrialRefused`)."""

    __slots__ = ("kind", "args", "signature_id")

    def __init__(self, error: BaseException) -> None:
        self.kind = type(error)
        self.args = error.args
        self.signature_id = 0

    def error(self) -> BaseException:
        return self.kind(*self.args)

    @staticmethod
    def keeps(error: BaseException) -> bool:
        """Can the error be made again from its type and arguments, reading the same?"""
        try:
            again = type(error)(*error.args)
        except Exception:  # noqa: BLE001 - an exception type with another constructor
            return False
        return type(again) is type(error) and str(again) == str(error)


def _same_error(one: BaseException, other: BaseException) -> bool:
    return type(one) is type(other) and str(one) == str(other)


def _trial_value(value, name, fill, shaped):
    """A CPU stand-in for one argument of a trial: tensors of the argument's dtype, of one
    element per dimension (``shaped`` False) or of its own shape and strides, filled with
    ``fill`` (0 for positions); a device is the CPU."""
    if isinstance(value, torch.Tensor):
        value_fill = 0 if name in _INDEX_ARGUMENTS else fill
        if not shaped:
            return torch.full((1,) * value.dim(), value_fill, dtype=value.dtype)
        extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()) if size > 0)
        extent = 0 if value.numel() == 0 else extent
        return torch.full((extent,), value_fill, dtype=value.dtype).as_strided(value.shape, value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_trial_value(v, name, fill, shaped) for v in value)
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _trial_bytes(values) -> int:
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += _trial_bytes(value)
    return total


def _trial(entry, meta_args, meta_kwargs, fill, shaped):
    """The CPU's error for a trial of the op (None if it accepts), its warnings ignored."""
    names = [argument.name for argument in entry.op._schema.arguments]
    args = [_trial_value(value, name, fill, shaped) for value, name in zip(meta_args, names)]
    kwargs = {k: _trial_value(v, k, fill, shaped) for k, v in meta_kwargs.items()}
    try:
        warnings_of_call(entry.op, *args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the CPU's verdict on the trial
        return error
    return None


def trial_at_the_shapes(entry, args, kwargs, inference) -> None:
    """The CPU kernel's own checks for a signature the meta kernel accepted: what a meta
    kernel does not check (a dtype the kernel has no implementation for, ``out=``
    dtypes, arguments checked inside the kernel) raises at the call, as on the CPU and
    CUDA, rather than on the device's worker at the next sync point.

    First a trial on one-element CPU tensors of the arguments' dtypes (microseconds),
    for ops that validate their arguments (:func:`_validates_its_arguments`). Such
    tensors are not valid inputs of every op (a 3x3 pooling window, a layer norm over
    768 features), so when the CPU refuses that trial, or for the other ops, it is tried
    at the arguments' own shapes and strides (up to :data:`FULL_TRIAL_BYTES`), filled
    with ones and then with zeros. A refusal there raises :class:`TrialRefused`: the
    call runs on the host, on the user's data, and the CPU decides. Which ops are tried:
    :func:`tried_on_cpu`."""
    meta_args = to_meta(args)
    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    if _validates_its_arguments(entry.name) and _trial(entry, meta_args, meta_kwargs, 1, shaped=False) is None:
        return
    if _trial_bytes(list(meta_args) + list(meta_kwargs.values())) > FULL_TRIAL_BYTES:
        return
    error = _trial(entry, meta_args, meta_kwargs, 1, shaped=True)
    if error is None:
        return
    with_zeros = _trial(entry, meta_args, meta_kwargs, 0, shaped=True)
    host_visible = with_zeros is not None and _same_error(error, with_zeros) and Refused.keeps(error)
    raise TrialRefused(error, inference, host_visible)


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
        return warnings_of_call(entry.op, *args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the CPU refuses these arguments
        raise MetaRejected(error) from error


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
    meta_args = to_meta(args)
    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
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
    if any(v is not None and (v.is_quantized or v.dtype in QUANTIZED_DTYPES) for v in values) or any(
            isinstance(v, torch.dtype) and v in QUANTIZED_DTYPES for v in itertools.chain(meta_args, meta_kwargs.values())):
        raise users_error(quantized_refusal(entry.name))  # quantize_per_tensor: no quantized kernels here
    if any(v is not None and v.layout != torch.strided for v in values):
        return NO_META  # a sparse result (``to_sparse``): the CPU makes it (device/ops/sparse.py)
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
    inference = Inference(outputs, structure, cost, tuple(resized), given, resize_warns)
    if tried_on_cpu(entry):
        trial_at_the_shapes(entry, args, kwargs, inference)  # raises TrialRefused
    return inference


def _strides_as_the_cpu_resizes(op, args, kwargs, resized):
    """A pointwise op's ``out=`` tensors of another shape: the CPU's TensorIterator gives
    a resized output the strides of its inputs' layout (``torch.add(x.permute(0, 2, 1),
    1, out=torch.empty(0))`` has the permuted strides), where the meta kernels resize it
    contiguous. A CPU probe (``probe_on_cpu``, once per signature) gives the CPU's;
    where the probe fails (zeros it cannot take), the meta kernel's stand."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the probe's own (its out= resized), Python's and C++'s
            result = _native.call_quietly("", probe_on_cpu, op, to_meta(args),
                                          {k: to_meta(v) for k, v in kwargs.items()})
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
