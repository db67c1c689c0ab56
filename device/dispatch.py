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
from .storage import DeviceStorage, storage_nbytes
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
    key = [entry]
    reads = []
    refs = []
    nested = False
    for value in args:
        if type(value) is NeuronTensor:
            key.append(value._sig)
            reads.append(value._storage)
            refs.append(value._ref)
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
                kwrefs[name] = value._ref
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
        entry.op, refs, kwrefs, nested, reads, writes, results, capture_location(), inference.cost, key, _STREAMS.current
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


def run_view(entry, args, kwargs):
    """A view: computed on the CPU backing tensor, no data touched, no launch."""
    base = args[0]
    if type(base) is not NeuronTensor:
        base = next(a for a in args if type(a) is NeuronTensor)
    storage = base._storage
    storage.aliased = True
    host_args, host_kwargs = _host_args(entry, args, kwargs)
    result = entry.op(*host_args, **host_kwargs)
    COUNTERS.view_ops += 1
    if isinstance(result, _Tensor):
        return wrap_view(result, storage)
    return type(result)(wrap_view(view, storage) for view in result)


_METADATA_SYNC = {aten.resize_.default, aten.set_.source_Tensor, aten.set_.source_Storage,
                  aten.set_.source_Storage_storage_offset, aten.set_.default}


def run_metadata(entry, args, kwargs):
    """In-place metadata changes (``t_``, ``unsqueeze_``, ``resize_``): applied to a fresh
    CPU alias of the tensor, then mirrored onto the neuron tensor."""
    tensor = args[0]
    if entry.op in _METADATA_SYNC:
        _sync.synchronize(f"metadata: {entry.name}")
    host = cpu_view(tensor)
    alias = host.as_strided(host.shape, host.stride(), host.storage_offset())
    host_args, host_kwargs = _host_args(entry, args[1:], kwargs)
    entry.op(alias, *host_args, **host_kwargs)
    source = next((a for a in args[1:] if type(a) is NeuronTensor), None)
    if source is not None:  # set_(source): now aliases the source's storage
        tensor._storage = source._storage
    tensor._storage.aliased = True
    mirror_metadata(tensor, alias)
    COUNTERS.view_ops += 1
    return tensor


def mirror_metadata(tensor: NeuronTensor, host: torch.Tensor) -> None:
    """Give the wrapper ``host``'s sizes, strides and offset."""
    set_wrapper_metadata(tensor, host.shape, host.stride(), host.storage_offset())
    tensor._ref = host
    tensor._sig = (tuple(host.shape), host.stride(), host.dtype)


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
