"""Recording a kernel: the low-level recorder under the op routing (``dispatch.py``).

Entry points: :func:`record_kernel` (a kernel op -> outputs now, an :class:`OpRecord` handed to
the sink) and :func:`allocate` (``empty``-like ops: memory, no kernel).

A kernel is *recorded*: output metadata from cached shape inference (``shapes.py``),
output tensors created at once over fresh storages, and an :class:`OpRecord` of
references to the storages it reads and writes handed to the sink (strict: launched at
once; adaptive: buffered in a window). Ops the device cannot queue (no meta kernel, a
meta kernel that rejects the arguments, a random op that must draw on the host) run on
the host instead (``host_ops.run_on_host``).

This is the per-op hot path; keep it free of ``tree_map``, ``inspect`` and full stack
walks. ``bench/overhead.py`` measures it. Its common case, a kernel whose signature hits
the shape cache, is also written in C (``device/csrc/record.cpp``, installed by
``dispatch.install_native_recorder``), which the registered kernels try first: a change to what
a record, a signature or a launch holds is made in both, and
``tests/device/test_native_record.py`` compares them record by record and clock by clock.
"""
from __future__ import annotations

from time import perf_counter

import torch

from ..core.config import CONFIG
from ..core.counters import COUNTERS
from ..core.location import capture_location, warn_at_user_line
from ..core.reasons import Flush
from ..hardware import sink
from ..hardware.execution_queue import QUEUE
from ..hardware.op_record import OpRecord
from ..hardware.profiler import PROFILER
from ..hardware.profiler import issued as profiler_issued
from ..hardware.streams import STATE as _STREAMS
from ..memory.indices import check_ordinal, current_index
from ..memory.storage import DeviceStorage, storage_nbytes
from ..memory.tensor import describe, device_tensor, reference, storage_of
from . import overlap
from .device_guard import DeviceMismatchError, mismatch
from .host_ops import run_on_host, run_random_on_host_with_device_generator
from .index_checks import INDEXING, NeedsTheData, refuse_device_indices_of_a_host_tensor
from .rng import GENERATOR, generator_twin
from ..core.errors import users_error
from .shapes import (
    NO_META, RESIZED_WARNING, SHAPE_CACHE, SHAPE_CACHE_SIZE, Inference, MetaRejected, Refused, TrialRefused, infer,
)
from .op_table import op_entry
from .views import deterministic_fill_value, set_metadata

aten = torch.ops.aten
CPU = torch.device("cpu")
_Tensor = torch.Tensor
_SCALARS = (int, float, bool)
_default_dtype = torch.get_default_dtype

# Ops that may take CPU tensors of any rank beside neuron ones, as CUDA's indexing does
# (``_to_copy`` of a host tensor is an upload, ``dispatch._upload``).
_HOST_TENSORS_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                    aten._index_put_impl_.default, aten.copy_.default, aten._to_copy.default,
                    # a CPU index in index_fill (issue 19: PyTorch's suites pass one)
                    aten.index_fill.int_Tensor, aten.index_fill.int_Scalar,
                    aten.index_fill_.int_Tensor, aten.index_fill_.int_Scalar}


_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def _mismatch(entry, tensor) -> DeviceMismatchError:
    """A tensor on another device among a device op's arguments: CUDA's error."""
    return mismatch(entry, f"neuron:{current_index()}", tensor.device)


# While a compiled graph's call is recorded (adaptive_eager/replay.py): id(snapshot) ->
# the host tensor it was taken of, so that a replay takes it again of the new input.
HOST_SNAPSHOTS = None


def _host_tensor(entry, tensor, parts):
    """A CPU tensor argument of a device op: CUDA's rule, 0-dim ones mix freely."""
    if tensor.dim() != 0 and entry.op not in _HOST_TENSORS_OK:
        raise _mismatch(entry, tensor)
    parts.append(("host", tuple(tensor.shape), tensor.stride(), tensor.dtype))
    snapshot = tensor.clone()  # the host may change it before the kernel runs
    if HOST_SNAPSHOTS is not None:
        HOST_SNAPSHOTS[id(snapshot)] = tensor
    return snapshot


def _device_argument(value, described, parts, reads):
    """Record one neuron tensor argument (``described``: its ``describe``): its signature
    into ``parts``, its storage into ``reads``; returns its reference, the storage itself
    when the tensor covers it exactly (else a ``ViewRef`` or ``ReinterpretRef``)."""
    signature, storage, covers = described
    if storage is None:
        storage = storage_of(value)
    parts.append(signature)
    reads.append(storage)
    return storage if covers else reference(value, signature, storage, covers)


def _convert(entry, value, parts, reads):
    """Record one argument that is not a neuron tensor: returns its reference, extends the
    parts."""
    kind = type(value)
    if kind is list or kind is tuple:
        sub = []
        refs = []
        for item in value:
            described = describe(item)
            if described is not None:
                refs.append(_device_argument(item, described, sub, reads))
            else:
                refs.append(_convert(entry, item, sub, reads))
        parts.append(tuple(sub))
        return refs if kind is list else tuple(refs)
    if kind in _SCALARS:
        parts.append(kind)
        if kind is not float or entry.scalar_values_matter:
            parts.append(value)
        else:
            parts.append(float_class(value))
        return value
    if isinstance(value, _Tensor):
        if value.device.type == "neuron":  # a neuron tensor of no storage (FakeTensor's own)
            raise _mismatch(entry, value)
        return _host_tensor(entry, value, parts)
    if kind is torch.device:
        if value.type == "neuron":
            check_ordinal(value)
            parts.append("neuron")
            return CPU
        raise _mismatch(entry, torch.empty(1, device=value) if value.type == "meta" else torch.empty(1))
    if kind is torch.Generator:
        parts.append("generator")
        return value
    parts.append(value)
    return value


def float_class(value: float) -> int:
    """What a signature keeps of a float whose value cannot change output metadata: its
    sign (0, 1, -1; 2 for NaN), which the CPU's argument checks depend on (CELU's alpha
    must not be 0, smooth L1's beta must not be negative), so a cached signature never
    lets a value the CPU refuses through (``shapes.check_on_cpu`` runs on a miss)."""
    return 1 if value > 0.0 else -1 if value < 0.0 else 0 if value == 0.0 else 2


def _is_device(value) -> bool:
    return describe(value) is not None


def _record_call(entry, args, kwargs):
    """Convert the call: (signature parts, reference args, reference kwargs, storages read,
    whether an argument needs more than a storage lookup to resolve)."""
    parts = [entry.serial, _default_dtype()]  # int division, factories: the default dtype decides
    reads = []
    refs = []
    nested = False
    for value in args:
        described = describe(value)
        if described is not None:
            ref = _device_argument(value, described, parts, reads)
            nested = nested or not described[2]  # a view's reference resolves with as_strided
            refs.append(ref)
        else:
            if not refs and entry.op in INDEXING:  # a host tensor indexed
                refuse_device_indices_of_a_host_tensor(entry, value)
            if type(value) is list or type(value) is tuple:
                nested = True
            refs.append(_convert(entry, value, parts, reads))
    kwrefs = {}
    if kwargs:
        for name, value in kwargs.items():
            parts.append(name)
            described = describe(value)
            if described is not None:
                kwrefs[name] = _device_argument(value, described, parts, reads)
                nested = nested or not described[2]
            else:
                if type(value) is list or type(value) is tuple:
                    nested = True
                kwrefs[name] = _convert(entry, value, parts, reads)
    if entry.generator_arg is not None:
        generator = kwrefs.get("generator")
        if generator is None:
            kwrefs["generator"] = GENERATOR
        else:
            twin = generator_twin(generator)
            if twin is not None:  # a neuron generator: draws through its CPU twin, in queue order
                kwrefs["generator"] = twin
    return parts, refs, kwrefs, reads, nested


def record_kernel(entry, args, kwargs):
    """Record a kernel: outputs now, computation on the queue."""
    trace = QUEUE.trace_recorder
    started = perf_counter() if trace is not None else 0.0
    if entry.rewrite is not None:
        entry = entry.rewrite
    if entry.random and (entry.host_random or _explicit_generator(kwargs)) and _draws(entry, args, kwargs):
        return run_on_host(entry, args, kwargs or {}, Flush.RANDOM_ON_HOST)
    try:
        signature, refs, kwrefs, reads, nested = _record_call(entry, args, kwargs)
    except DeviceMismatchError:
        if entry.random and _neuron_generator(kwargs):
            # Host tensors drawing from a neuron generator (Diffusers' randn_tensor):
            # the generator's stream, on the host, in program order (host_ops).
            return run_random_on_host_with_device_generator(entry, args, kwargs)
        if not entry.composite:
            raise
        # A composite written for every device, taking host tensors where it means to
        # (``pack_padded_sequence``'s CPU lengths): run it, its ops come back here.
        return entry.op._op_dk(_COMPOSITE, *args, **(kwargs or {}))
    signature = tuple(signature)
    if (entry.mutated and overlap.aliased(reads)
            and overlap.writes_shared(reads, _mutated_storages(entry, args, kwargs))
            and overlap.refused(entry, signature, args, kwargs)):
        return run_on_host(entry, args, kwargs or {}, Flush.MEMORY_OVERLAP)  # raises the CPU's error
    inference = SHAPE_CACHE.get(signature)
    if inference is None:
        try:
            inference = infer(entry, args, kwargs or {}, _is_device)
        except TrialRefused as refused:  # the CPU kernel refused a trial: the CPU decides on the data
            return _decided_on_the_host(entry, signature, args, kwargs or {}, refused)
        except MetaRejected:
            return run_on_host(entry, args, kwargs or {}, Flush.META_REJECTED)
        except NeedsTheData:  # a mask's count decides: a data-dependent op
            return run_on_host(entry, args, kwargs or {}, Flush.DATA_DEPENDENT)
        if inference is not NO_META:
            inference.signature = signature
        _cache(signature, inference)
    else:
        SHAPE_CACHE.move_to_end(signature)
    if inference.__class__ is not Inference:
        if inference is NO_META:
            return run_on_host(entry, args, kwargs or {}, Flush.FALLBACK)
        raise users_error(inference.error())  # a Refused signature: the CPU's error, at the call
    if inference.warnings:
        _forward_warnings(inference.warnings)
    if inference.resized:
        _resize_outputs(inference.resized, args, kwargs, inference.resize_warns)
        signature, refs, kwrefs, reads, nested = _record_call(entry, args, kwargs)
        signature = tuple(signature)

    results = []
    outputs = []
    for spec in inference.outputs:
        if spec is None:
            results.append(None)
            outputs.append(None)
            continue
        storage = DeviceStorage(spec.shape, spec.stride, spec.dtype, spec.nbytes)
        results.append(storage)
        outputs.append(device_tensor(spec.shape, spec.stride, spec.dtype, storage, spec.nbytes))
    writes = tuple(_mutated_storages(entry, args, kwargs)) if entry.mutated else ()
    issue = QUEUE.issued = QUEUE.issued + 1
    record = OpRecord(
        entry.op, refs, kwrefs, nested, reads, writes, results, capture_location(), inference.cost,
        inference.signature, inference.signature_id, _STREAMS.current, issue,
    )
    COUNTERS.ops_recorded += 1
    QUEUE.host_us += CONFIG.host_us_per_op
    if trace is not None:
        trace.issue(record, started)
    if PROFILER._is_profiler_enabled:  # the one check per op when nothing profiles
        profiler_issued(record)
    sink._sink.record(record)
    return _build_return(entry, inference.structure, outputs, args, kwargs)


def _decided_on_the_host(entry, signature, args, kwargs, refused):
    """A signature the meta kernel accepted and the CPU kernel refused on trial values
    (``shapes.trial_at_the_shapes``): the call runs on the host, on its data. If the CPU
    raises the trial's error there too, and the trial's ones and zeros were refused
    alike (``refused.host_visible``), no value decides it: the signature is cached as
    :class:`~.shapes.Refused`, and each later call raises that error at once. If the CPU
    accepts the data, the trial's values were refused (a data check): the signature is
    cached with its metadata and later calls run on the device, where a failure is
    deferred, as on CUDA."""
    try:
        result = run_on_host(entry, args, kwargs, Flush.META_REJECTED)
    except Exception as error:
        if refused.host_visible and type(error) is type(refused.error) and str(error) == str(refused.error):
            _cache(signature, Refused(error))
        raise
    refused.inference.signature = signature
    _cache(signature, refused.inference)
    return result


def _cache(signature, value) -> None:
    SHAPE_CACHE[signature] = value
    if len(SHAPE_CACHE) > SHAPE_CACHE_SIZE:
        SHAPE_CACHE.popitem(last=False)  # the least recently used signature


def _draws(entry, args, kwargs) -> bool:
    """Does this call of a random op draw? Not a fused attention kernel's with no dropout:
    it is tagged random for its dropout alone (``OpEntry.dropout_arg``)."""
    dropout = entry.dropout_arg
    if dropout is None:
        return True
    index, name = dropout
    value = args[index] if index < len(args) else (kwargs or {}).get(name, 0.0)
    return value != 0.0


def _neuron_generator(kwargs) -> bool:
    generator = kwargs.get("generator") if kwargs else None
    return generator is not None and generator.device.type == "neuron"


def _explicit_generator(kwargs) -> bool:
    """A caller's own CPU generator: the host may draw from it right after this op, so the
    op draws now, on the host, in program order (``rng.py``). A neuron generator only
    the device draws from: it stays on the queue."""
    generator = kwargs.get("generator") if kwargs else None
    return generator is not None and generator is not GENERATOR and generator.device.type != "neuron"


def _resize_outputs(resized, args, kwargs, warns=True):
    """``out=`` tensors of the wrong shape are resized as ATen's ``resize_`` does: new
    contiguous metadata over the same storage at the same offset when it is large
    enough (so a view written through still writes its base), else a fresh storage of
    the right size (growing from empty is the common case: ``torch.arange(n, out=...)``)."""
    for index, name, spec in resized:
        tensor = args[index] if index < len(args) else kwargs[name]
        if warns and tensor.numel() and tuple(tensor.shape) != tuple(spec.shape):
            _warn_resized(tensor.shape, spec.shape)
        offset = tensor.storage_offset()
        needed = (storage_nbytes(spec.shape, spec.stride, 1) + offset) * tensor.element_size()
        if spec.dtype == tensor.dtype and tensor.untyped_storage().nbytes() >= needed:
            set_metadata(tensor, tensor.untyped_storage(), offset, spec.shape, spec.stride)
            continue
        storage = DeviceStorage(spec.shape, spec.stride, spec.dtype, spec.nbytes)
        fresh = device_tensor(spec.shape, spec.stride, spec.dtype, storage, spec.nbytes)
        set_metadata(tensor, fresh.untyped_storage(), 0, spec.shape, spec.stride)


def _forward_warnings(kept) -> None:
    """The CPU's warnings for this call's arguments (``shapes.check_on_cpu``), at the
    user's line, at each call: the kernel runs on the worker, whose warnings reach no one."""
    for message, category in kept:
        warn_at_user_line(message, category)


def _warn_resized(shape, required) -> None:
    """ATen's warning for an out= tensor with elements resized (resize_output), at each
    call as the CPU gives it."""
    warn_at_user_line(
        f"{RESIZED_WARNING} since it had shape {list(shape)}, which does not match the required output shape "
        f"{list(required)}. This behavior is deprecated, and in a future PyTorch release outputs will not be "
        "resized unless they have zero elements. You can explicitly reuse an out tensor t by resizing it, "
        "inplace, to zero elements with t.resize_(0)."
    )


def _mutated_storages(entry, args, kwargs):
    for index, name in entry.mutated:
        value = args[index] if index < len(args) else (kwargs or {}).get(name)
        if isinstance(value, (list, tuple)):
            for item in value:
                if describe(item) is not None:
                    yield storage_of(item)
        elif describe(value) is not None:
            yield storage_of(value)
        elif isinstance(value, _Tensor):
            raise _mismatch(entry, value)


def _build_return(entry, structure, outputs, args, kwargs):
    aliases = entry.return_alias
    if structure == "tensor":
        alias = aliases[0]
        if alias is None:
            return outputs[0]
        index, name = alias
        return args[index] if index < len(args) else kwargs[name]
    if structure == "none":
        return None
    if structure == "list":
        return outputs
    values = []
    for output, alias in zip(outputs, aliases):
        if alias is None:
            values.append(output)
        else:
            index, name = alias
            values.append(args[index] if index < len(args) else kwargs[name])
    return tuple(values)


_LAYOUTS: dict = {}  # an empty-like call's _layout_key -> (shape, stride, dtype, nbytes), from its meta run
_MAX_LAYOUTS = 4096


def allocate(entry, args, kwargs):
    """``empty``-like ops: a fresh storage, allocated on the host, no kernel. The layout is
    the op's own on the meta device, run once per distinct call (``_layout_key``)."""
    device = kwargs.get("device")
    if device is not None and device.type == "neuron":
        check_ordinal(device)
    key = _layout_key(entry, args, kwargs)
    layout = _LAYOUTS.get(key) if key is not None else None
    if layout is None:
        meta_kwargs = {k: (torch.device("meta") if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
        meta_args = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, _Tensor) else a
            for a in args
        ]
        meta = entry.op(*meta_args, **meta_kwargs)
        shape, stride = tuple(meta.shape), tuple(meta.stride())
        layout = (shape, stride, meta.dtype, storage_nbytes(shape, stride, meta.element_size()))
        if key is not None and len(_LAYOUTS) < _MAX_LAYOUTS:
            _LAYOUTS[key] = layout
    shape, stride, dtype, nbytes = layout
    # no bytes yet: the first kernel writing it makes them (an upload's copy), or a read
    tensor = device_tensor(shape, stride, dtype, DeviceStorage(shape, stride, dtype, nbytes), nbytes)
    fill = deterministic_fill_value(dtype)
    if fill is not None:  # deterministic mode: NaN or the largest value, as ATen's empty writes
        record_kernel(op_entry(aten.fill_.Scalar), (tensor, fill), {})
    return tensor


def _layout_key(entry, args, kwargs):
    """What an empty-like call's layout depends on: its op, its arguments (sizes, a tensor's
    layout, dtype, memory format...) and the default dtype; None (not cached) for an
    argument of another kind (a symbolic size)."""
    key = [entry.op, torch.get_default_dtype()]
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind is list or kind is tuple:
            if not all(type(v) is int for v in value):
                return None
            key.append(tuple(value))
        elif isinstance(value, _Tensor):
            key.append((value.shape, value.stride(), value.dtype))
        elif kind in _HASHABLE or isinstance(value, _HASHABLE_CLASSES):
            key.append(value)
        else:
            return None
    key.append(tuple(kwargs))
    return tuple(key)


_HASHABLE = (int, float, bool, type(None), str)
_HASHABLE_CLASSES = (torch.dtype, torch.layout, torch.memory_format, torch.device)
