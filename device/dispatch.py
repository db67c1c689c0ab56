"""Op interception: every aten op on a neuron tensor, and every factory with
``device='neuron'``, arrives at :func:`dispatch`.

What happens to an op depends on its kind (``op_table``):

- kernels (functional, in-place, ``out=``, factories) are *recorded*: output metadata from
  cached shape inference, output tensors created at once over fresh storages, and an
  :class:`OpRecord` handed to the sink (strict: launched at once; adaptive: buffered);
- views run on the host at once, over the CPU backing tensor; they launch nothing;
- host reads (``item``, printing, ``.cpu()``) and data-dependent ops (``nonzero``) are
  sync points; ops without a meta kernel run on the CPU fallback, counted by name.

This is the per-op hot path; keep it free of ``tree_map``, ``inspect`` and full stack
walks. ``bench/overhead.py`` measures it.
"""
from __future__ import annotations

from time import perf_counter

import torch

from . import sync as _sync
from .config import CONFIG
from .errors import poisoned_read_error
from .kernel import OpRecord
from .location import capture_location
from .metrics import COUNTERS
from .op_table import _ENTRIES, COPY, DATA_DEPENDENT, HOST_READ, KERNEL, METADATA, NO_OP, VIEW, op_entry
from .queue import QUEUE
from .random import GENERATOR
from .shapes import NO_META, SHAPE_CACHE, MetaRejected, infer
from .storage import DeviceStorage, ViewRef, storage_nbytes
from .streams import STATE as _STREAMS
from .tensor import NEURON, NeuronTensor, cpu_view, set_wrapper_metadata, wrap_fresh, wrap_view

aten = torch.ops.aten
CPU = torch.device("cpu")
_Tensor = torch.Tensor
_SCALARS = (int, float, bool)

# Ops that may take CPU tensors of any rank beside neuron ones, as CUDA's indexing does.
_HOST_TENSORS_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                    aten._index_put_impl_.default, aten.copy_.default}


class DeviceMismatchError(RuntimeError):
    pass


def _mismatch(entry, tensor) -> DeviceMismatchError:
    return DeviceMismatchError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"neuron:0 and {tensor.device}! (when checking arguments for {entry.name})"
    )


def _host_tensor(entry, tensor, key):
    """A CPU tensor argument of a device op: CUDA's rule, 0-dim ones mix freely."""
    if tensor.dim() != 0 and entry.op not in _HOST_TENSORS_OK:
        raise _mismatch(entry, tensor)
    key.append(("host", tuple(tensor.shape), tensor.stride(), tensor.dtype))
    return tensor.clone()  # the host may change it before the kernel runs


def _convert(entry, value, key, reads):
    """Record one non-NeuronTensor argument: returns its reference, extends the key."""
    kind = type(value)
    if kind is list or kind is tuple:
        sub = []
        refs = []
        for item in value:
            if type(item) is NeuronTensor:
                sub.append(item._sig)
                reads.append(item._storage)
                refs.append(item._ref)
            else:
                refs.append(_convert(entry, item, sub, reads))
        key.append(tuple(sub))
        return refs if kind is list else tuple(refs)
    if kind in _SCALARS:
        key.append(kind)
        if kind is not float or entry.scalar_values_matter:
            key.append(value)
        return value
    if isinstance(value, _Tensor):
        return _host_tensor(entry, value, key)
    if kind is torch.device:
        if value.type == "neuron":
            key.append("neuron")
            return CPU
        raise _mismatch(entry, torch.empty(1, device=value) if value.type == "meta" else torch.empty(1))
    if kind is torch.Generator:
        key.append("generator")
        return value
    key.append(value)
    return value


def _is_device(value) -> bool:
    return type(value) is NeuronTensor


def _record_call(entry, args, kwargs):
    """Convert the call: (key parts, reference args, reference kwargs, storages read,
    whether a list argument holds references)."""
    key = [entry.serial]
    reads = []
    refs = []
    nested = False
    for value in args:
        if type(value) is NeuronTensor:
            key.append(value._sig)
            reads.append(value._storage)
            ref = value._ref
            if type(ref) is not DeviceStorage:
                nested = True
            refs.append(ref)
        else:
            if type(value) is list or type(value) is tuple:
                nested = True
            refs.append(_convert(entry, value, key, reads))
    kwrefs = {}
    if kwargs:
        for name, value in kwargs.items():
            key.append(name)
            if type(value) is NeuronTensor:
                key.append(value._sig)
                reads.append(value._storage)
                ref = kwrefs[name] = value._ref
                if type(ref) is not DeviceStorage:
                    nested = True
            else:
                if type(value) is list or type(value) is tuple:
                    nested = True
                kwrefs[name] = _convert(entry, value, key, reads)
    if entry.generator_arg is not None and kwrefs.get("generator") is None:
        kwrefs["generator"] = GENERATOR
    return key, refs, kwrefs, reads, nested


def dispatch(func, args, kwargs):
    entry = _ENTRIES.get(func)
    if entry is None:
        entry = op_entry(func)
    kind = entry.kind
    if kind is KERNEL:
        if entry.allocation:
            return _allocate(entry, args, kwargs or {})
        return launch(entry, args, kwargs)
    if kind is VIEW:
        return run_view(entry, args, kwargs or {})
    if kind is COPY:
        return run_copy(entry, args, kwargs or {})
    if kind is HOST_READ:
        return run_on_host(entry, args, kwargs or {}, "host_read")
    if kind is DATA_DEPENDENT:
        return run_on_host(entry, args, kwargs or {}, "data_dependent")
    if kind is METADATA:
        return run_metadata(entry, args, kwargs or {})
    if kind is NO_OP:
        return None
    raise AssertionError(f"unknown op kind {kind}")


def launch(entry, args, kwargs):
    """Record a kernel: outputs now, computation on the queue."""
    trace = QUEUE.trace
    started = perf_counter() if trace is not None else 0.0
    if entry.rewrite is not None:
        entry = entry.rewrite
    key, refs, kwrefs, reads, nested = _record_call(entry, args, kwargs)
    key = tuple(key)
    inference = SHAPE_CACHE.get(key)
    if inference is None:
        try:
            inference = infer(entry, args, kwargs or {}, _is_device)
        except MetaRejected:
            return run_on_host(entry, args, kwargs or {}, "meta_rejected")
        if inference is not NO_META:
            inference.key = key
        SHAPE_CACHE[key] = inference
    if inference is NO_META:
        return run_on_host(entry, args, kwargs or {}, "fallback")
    if inference.resized:
        _resize_outputs(inference.resized, args, kwargs)
        key, refs, kwrefs, reads, nested = _record_call(entry, args, kwargs)
        key = tuple(key)

    results = []
    outputs = []
    for spec in inference.outputs:
        if spec is None:
            results.append(None)
            outputs.append(None)
            continue
        storage = DeviceStorage(spec.shape, spec.stride, spec.dtype, spec.nbytes)
        results.append(storage)
        outputs.append(wrap_fresh(spec.shape, spec.stride, spec.dtype, storage, spec.signature))
    writes = tuple(_mutated_storages(entry, args, kwargs)) if entry.mutated else ()
    record = OpRecord(
        entry.op, refs, kwrefs, nested, reads, writes, results, capture_location(), inference.cost,
        inference.key, inference.key_id, _STREAMS.current,
    )
    COUNTERS.ops_recorded += 1
    QUEUE.host_us += QUEUE.host_us_per_op
    if trace is not None:
        trace.issue(record, started)
    _sync._sink.record(record, outputs)
    return _build_return(entry, inference.structure, outputs, args, kwargs)


def _resize_outputs(resized, args, kwargs):
    """``out=`` tensors of the wrong shape get a fresh storage of the right one, as ATen
    resizes them (growing from empty is the common case: ``torch.arange(n, out=...)``)."""
    for index, name, spec in resized:
        tensor = args[index] if index < len(args) else kwargs[name]
        storage = DeviceStorage(spec.shape, spec.stride, spec.dtype, spec.nbytes)
        storage.materialize()  # no kernel produces it: the op writes into it
        tensor._storage = storage
        set_wrapper_metadata(tensor, spec.shape, spec.stride, 0)
        tensor._ref = storage
        tensor._sig = spec.signature


def _mutated_storages(entry, args, kwargs):
    for index, name in entry.mutated:
        value = args[index] if index < len(args) else (kwargs or {}).get(name)
        if type(value) is NeuronTensor:
            yield value._storage
        elif isinstance(value, (list, tuple)):
            for item in value:
                if type(item) is NeuronTensor:
                    yield item._storage
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


def _allocate(entry, args, kwargs):
    """``empty``-like ops: a fresh storage, allocated on the host, no kernel."""
    meta_kwargs = {k: (torch.device("meta") if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
    meta_args = [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, _Tensor) else a
        for a in args
    ]
    meta = entry.op(*meta_args, **meta_kwargs)
    shape, stride = tuple(meta.shape), tuple(meta.stride())
    storage = DeviceStorage(shape, stride, meta.dtype, storage_nbytes(shape, stride, meta.element_size()))
    storage.materialize()
    return wrap_fresh(shape, stride, meta.dtype, storage, (shape, stride, meta.dtype))


# -- views and metadata ---------------------------------------------------------------
def _host_args(entry, args, kwargs, check_poison=False):
    """Arguments with neuron tensors replaced by their CPU backing tensors."""

    def convert(value):
        if type(value) is NeuronTensor:
            if check_poison and value._storage.poison is not None:
                raise poisoned_read_error(value._storage.poison)
            return cpu_view(value)
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        if isinstance(value, torch.device) and value.type == "neuron":
            return CPU
        if entry.generator_arg is not None and value is None:
            return value
        return value

    host_args = [convert(a) for a in args]
    host_kwargs = {k: convert(v) for k, v in kwargs.items()}
    if entry.generator_arg is not None and host_kwargs.get("generator") is None:
        host_kwargs["generator"] = GENERATOR
    return host_args, host_kwargs


_VIEW_CACHE: dict = {}  # view signature -> output metadata [(shape, stride, offset, dtype)]


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (int, float, bool)):
        return (type(value), value)
    return value


def _meta_of(tensor: NeuronTensor) -> torch.Tensor:
    """A meta tensor with ``tensor``'s exact metadata, offset included."""
    span = storage_nbytes(tensor.shape, tensor.stride(), 1) + tensor.storage_offset()
    return torch.empty(span, dtype=tensor.dtype, device="meta").as_strided(
        tensor.shape, tensor.stride(), tensor.storage_offset()
    )


def _view_outputs(entry, base, args, kwargs):
    """Output metadata of a view op, from the view cache (a meta run on a miss)."""
    rest = args[1:]
    key = None
    # A view op's non-tensor arguments are ints, bools and int lists, one type per schema
    # position, so their values key the cache (no int/float/bool collisions to guard).
    parts = [entry.serial, base._sig, base.storage_offset()]
    for value in rest:
        kind = type(value)
        if kind is list or kind is tuple:
            parts.append(tuple(value))
        elif isinstance(value, _Tensor):
            parts = None
            break
        else:
            parts.append(value)
    if parts is not None and kwargs:
        for name, value in kwargs.items():
            if isinstance(value, _Tensor):
                parts = None
                break
            parts.append(name)
            parts.append(_hashable(value))
    if parts is not None:
        key = tuple(parts)
        outputs = _VIEW_CACHE.get(key)
        if outputs is not None:
            return outputs
    meta_rest = [_meta_of(v) if type(v) is NeuronTensor else v for v in rest]
    result = entry.op(_meta_of(base), *meta_rest, **kwargs)
    views = (result,) if isinstance(result, _Tensor) else tuple(result)
    outputs = tuple(
        (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype if not (v.is_conj() or v.is_neg()) else None)
        for v in views
    )
    outputs = (isinstance(result, _Tensor), type(result), outputs)
    if key is not None:
        if len(_VIEW_CACHE) > 65536:
            _VIEW_CACHE.clear()
        _VIEW_CACHE[key] = outputs
    return outputs


def run_view(entry, args, kwargs):
    """A view: new metadata over the same storage. No data touched, no launch, no memory;
    kernels resolve it when they run (``ViewRef``)."""
    base = args[0]
    if type(base) is not NeuronTensor:
        base = next(a for a in args if type(a) is NeuronTensor)
    storage = base._storage
    COUNTERS.view_ops += 1
    single, container, outputs = _view_outputs(entry, base, args, kwargs)
    if any(dtype is not base.dtype for _, _, _, dtype in outputs):
        return _host_view(entry, storage, args, kwargs)
    views = [wrap_view(storage, shape, stride, offset, dtype) for shape, stride, offset, dtype in outputs]
    return views[0] if single else container(views)


def _host_view(entry, storage, args, kwargs):
    """Views a ``ViewRef`` cannot describe: another dtype over the same bytes
    (``view(dtype)``, ``view_as_real``) or a conjugate/negative bit (``_conj``). Computed on
    the materialized CPU bytes; the storage is pinned (always written back)."""
    _sync.flush(f"host view: {entry.name}")
    storage.pinned = True
    host_args, host_kwargs = _host_args(entry, args, kwargs)
    result = entry.op(*host_args, **host_kwargs)
    views = (result,) if isinstance(result, _Tensor) else tuple(result)
    wrapped = []
    for view in views:
        tensor = wrap_view(storage, tuple(view.shape), tuple(view.stride()), view.storage_offset(), view.dtype)
        tensor._ref = view  # a CPU tensor over the storage's bytes
        wrapped.append(tensor)
    return wrapped[0] if isinstance(result, _Tensor) else type(result)(wrapped)


_METADATA_SYNC = {aten.resize_.default, aten.resize_as_.default, aten.set_.source_Tensor, aten.set_.source_Storage,
                  aten.set_.source_Storage_storage_offset, aten.set_.default}


def run_metadata(entry, args, kwargs):
    """In-place metadata changes (``t_``, ``unsqueeze_``, ``resize_``, ``set_``).

    Pure metadata changes are computed on a meta tensor. ``resize_`` and ``set_`` may
    reallocate or re-point memory: they wait for the device and run on the CPU bytes.
    """
    tensor = args[0]
    if entry.op not in _METADATA_SYNC:
        meta = _meta_of(tensor)
        entry.op(meta, *(_meta_of(a) if type(a) is NeuronTensor else a for a in args[1:]), **kwargs)
        _set_metadata(tensor, tensor._storage, tuple(meta.shape), tuple(meta.stride()), meta.storage_offset())
        COUNTERS.view_ops += 1
        return tensor
    _sync.synchronize(f"metadata: {entry.name}")
    host = cpu_view(tensor)
    alias = host.as_strided(host.shape, host.stride(), host.storage_offset())
    host_args, host_kwargs = _host_args(entry, args[1:], kwargs)
    entry.op(alias, *host_args, **host_kwargs)
    source = next((a for a in args[1:] if type(a) is NeuronTensor), None) if entry.name == "aten::set_" else None
    storage = source._storage if source is not None else tensor._storage
    storage.pinned = True
    tensor._storage = storage
    _set_metadata(tensor, storage, tuple(alias.shape), tuple(alias.stride()), alias.storage_offset())
    COUNTERS.view_ops += 1
    return tensor


def _set_metadata(tensor: NeuronTensor, storage, shape, stride, offset: int) -> None:
    set_wrapper_metadata(tensor, shape, stride, offset)
    if offset == 0 and shape == storage.shape and stride == storage.stride:
        tensor._ref = storage
    else:
        tensor._ref = ViewRef(storage, shape, stride, offset)
    tensor._sig = (shape, stride, tensor.dtype)
    storage.add_view(tensor)


# -- copies, host reads, data-dependent ops and the CPU fallback ------------------------
def _neuron_args(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if type(value) is NeuronTensor:
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if type(v) is NeuronTensor)


def run_copy(entry, args, kwargs):
    op = entry.op
    if op is aten.copy_.default:
        dst, src = args[0], args[1]
        if type(dst) is NeuronTensor:
            return launch(entry, args, kwargs)  # device <- device, or device <- host
        return run_on_host(entry, args, kwargs, "copy_to_host")
    if op is aten._to_copy.default:
        source = args[0]
        device = kwargs.get("device")
        if type(source) is not NeuronTensor:  # host -> device
            return _upload(source, kwargs)
        if device is not None and device.type != "neuron":
            return run_on_host(entry, args, kwargs, "copy_to_host")
        return launch(entry, args, kwargs)
    if op is aten._copy_from.default:  # src.copy_(dst) with dst on the device
        src, dst = args[0], args[1]
        return dispatch(aten.copy_.default, (dst, src), {"non_blocking": args[2] if len(args) > 2 else False})
    return run_on_host(entry, args, kwargs, "fallback")


def _upload(source: torch.Tensor, kwargs):
    """``cpu_tensor.to('neuron')``: a fresh device tensor, then one copy kernel that reads
    a snapshot of the host tensor (and converts dtype if asked)."""
    if source.layout != torch.strided:
        raise NotImplementedError(
            f"{source.layout} tensors are not supported on the neuron device; convert with "
            ".to_dense() first"
        )
    meta_kwargs = dict(kwargs, device=torch.device("meta"))
    meta = aten._to_copy.default(torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device="meta"), **meta_kwargs)
    shape, stride = tuple(meta.shape), tuple(meta.stride())
    storage = DeviceStorage(shape, stride, meta.dtype, storage_nbytes(shape, stride, meta.element_size()))
    storage.materialize()  # the copy kernel writes into it
    target = wrap_fresh(shape, stride, meta.dtype, storage, (shape, stride, meta.dtype))
    launch(op_entry(aten.copy_.default), (target, source), {})
    return target


def run_on_host(entry, args, kwargs, reason):
    """Run an op on the CPU backing tensors after a sync point.

    Reasons: ``host_read`` (the result is a host value), ``copy_to_host``,
    ``data_dependent`` (output shape unknown until it runs), ``fallback`` (no meta kernel:
    the device cannot queue it) and ``meta_rejected`` (the meta kernel raised; the CPU
    decides whether this is the user's error or a meta kernel's).
    """
    if reason == "fallback" and not CONFIG.fallback:
        raise NotImplementedError(
            f"{entry.name} is not supported on the neuron device (no meta kernel to infer its "
            "output), and NEURON_FALLBACK=0 forbids running it on the CPU."
        )
    _sync.synchronize(f"{reason}: {entry.name}" if reason in ("fallback", "data_dependent") else reason)
    host_args, host_kwargs = _host_args(entry, args, kwargs, check_poison=True)
    result = entry.op(*host_args, **host_kwargs)
    if reason == "fallback" or reason == "meta_rejected":
        COUNTERS.fallback_ops[entry.name] += 1
    elif reason == "data_dependent":
        COUNTERS.ops_recorded += 1
        COUNTERS.kernels_launched += 1
    if reason in ("host_read", "copy_to_host"):
        return result
    return _upload_result(entry, result, args, kwargs)


def _upload_result(entry, result, args, kwargs):
    """Fresh CPU results of a host-run op become device tensors; mutated inputs are
    already updated in place (their CPU tensors alias device memory)."""
    if isinstance(result, _Tensor):
        return _upload_one(entry, result, args, kwargs, 0)
    if isinstance(result, (list, tuple)):
        return type(result)(
            _upload_one(entry, value, args, kwargs, i) if isinstance(value, _Tensor) else value
            for i, value in enumerate(result)
        )
    return result


def _upload_one(entry, value, args, kwargs, position):
    aliases = entry.return_alias
    alias = aliases[position] if position < len(aliases) else None
    if alias is not None:
        index, name = alias
        return args[index] if index < len(args) else kwargs[name]
    if value.layout != torch.strided:
        raise NotImplementedError(f"{entry.name} returned a {value.layout} tensor; sparse layouts are not supported on the neuron device")
    value = value.clone() if value._is_view() else value
    shape, stride = tuple(value.shape), value.stride()
    storage = DeviceStorage(shape, stride, value.dtype, storage_nbytes(shape, stride, value.element_size()), value)
    return wrap_fresh(shape, stride, value.dtype, storage, (shape, stride, value.dtype))
