"""Op routing: every aten op on a neuron tensor, and every factory with
``device='neuron'``, arrives at :func:`run` (from the PrivateUse1 kernels
``backend.py`` registers), which hands it to the handler of its kind (``op_table``):

| kind | handler |
| --- | --- |
| kernel | ``recorder.record_kernel`` (``recorder.allocate`` for ``empty``-like ops) |
| view | ``views.run_view``: the CPU kernel's view over the same storage, no launch |
| metadata | ``views.run_metadata``: ``t_``, ``resize_``, ``set_`` |
| copy | :func:`run_copy`: uploads, device copies (kernels), downloads (sync points) |
| host read, data-dependent | ``host_ops.run_on_host``: after a sync point |
| collective | ``collectives.run_collective``: gloo on the host bytes |
| decompose | :func:`decompose` (a composite seen when autograd is off) |
| like | :func:`run_like`: ``empty_like`` (metadata only) plus a fill kernel |
| no-op | nothing (``record_stream``) |
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..core import location
from ..core.config import CONFIG
from ..core.counters import COUNTERS
from ..core.errors import users_error
from ..core.reasons import Flush
from ..memory.indices import check_ordinal, current_index
from ..hardware import op_record, sink
from ..hardware.execution_queue import QUEUE
from ..hardware.profiler import PROFILER
from ..hardware.streams import STATE as STREAMS
from ..memory import tensor
from ..memory.storage import DeviceStorage, ViewRef
from ..memory.tensor import describe
from . import recorder, shapes
from .cow import COW, materialize_written
from .device_guard import mismatch
from .collectives import run_collective
from .host_ops import run_on_host
from .index_checks import INDEXING, has_mask, refuse_device_indices_of_a_host_tensor
from .op_table import (
    COLLECTIVE,
    COPY,
    DATA_DEPENDENT,
    DECOMPOSE,
    HOST_READ,
    KERNEL,
    LIKE,
    LIKE_FILLS,
    METADATA,
    NO_OP,
    VIEW,
    op_entry,
)
from .views import run_metadata, run_view

aten = torch.ops.aten


def run_op(op, args, kwargs):
    """``op`` (an ``OpOverload``) on the device: :func:`run` with its entry."""
    return run(op_entry(op), args, kwargs)


def run(entry, args, kwargs):
    """The op of ``entry`` (its ``op_table.OpEntry``) on the device: the per-op entry."""
    kind = entry.kind
    if entry.mutated and COW.live:  # a lazy clone's shared bytes are copied before a write (cow.py)
        materialize_written(entry, args, kwargs)
    if kind is KERNEL:  # the common case first
        if entry.allocation:
            return recorder.allocate(entry, args, kwargs or {})
        return recorder.record_kernel(entry, args, kwargs)
    return _HANDLERS[kind](entry, args, kwargs or {})


def run_copy(entry, args, kwargs):
    op = entry.op
    if op is aten.copy_.default:
        if describe(args[0]) is not None:
            return recorder.record_kernel(entry, args, kwargs)  # device <- device, or device <- host
        return run_on_host(entry, args, kwargs, Flush.COPY_TO_HOST)
    if op is aten._to_copy.default:
        device = kwargs.get("device")
        if describe(args[0]) is None:  # host -> device
            return _upload(args[0], kwargs)
        if device is not None and device.type != "neuron":
            return run_on_host(entry, args, kwargs, Flush.COPY_TO_HOST)
        if device is not None:
            check_ordinal(device)
        return recorder.record_kernel(entry, args, kwargs)
    if op is aten._copy_from.default:  # dst.copy_(src) with src on the device
        src, dst = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return run_op(aten.copy_.default, (dst, src), {"non_blocking": non_blocking})
    return run_on_host(entry, args, kwargs, Flush.FALLBACK)


def _upload(source: torch.Tensor, kwargs):
    """``cpu_tensor.to('neuron')``: one kernel that makes a fresh device tensor from a
    snapshot of the host tensor (the host may change it meanwhile), converting the dtype
    if asked. Its output is a result of the kernel, so an upload dropped after a failure
    leaves a poisoned tensor, never one of uninitialized memory."""
    if source.layout == torch.sparse_coo:  # its indices and values, each uploaded
        from .sparse import upload_sparse

        return upload_sparse(source, kwargs, _upload)
    if source.layout != torch.strided:
        raise users_error(NotImplementedError(
            f"{source.layout} tensors are not supported on the neuron device; convert with "
            ".to_dense() first"
        ))
    device = kwargs.get("device")
    if device is not None:
        check_ordinal(device)
    if type(source) is not torch.Tensor:  # the plain tensor: a subclass may refuse its own
        with torch._C.DisableTorchFunctionSubclass():  # accessors (a lazy module's
            source = source.as_subclass(torch.Tensor)  # UninitializedParameter's .shape)
    return recorder.record_kernel(op_entry(aten._to_copy.default), (source,), kwargs)


def decompose(entry, args, kwargs):
    """A composite of other ops: run its decomposition, whose ops come back here. The
    compressed sparse layouts stay refused (a composite would build a CSR tensor of neuron
    parts); a COO tensor of neuron parts is the device's (``device/ops/sparse.py``)."""
    if entry.layout_arg is not None:
        index, name = entry.layout_arg
        layout = args[index] if index < len(args) else kwargs.get(name)
        if layout is not None and layout not in (torch.strided, torch.sparse_coo):
            raise users_error(NotImplementedError(f"{layout} tensors are not supported on the neuron device ({entry.name})"))
    return entry.op.decompose(*args, **kwargs)


def run_like(entry, args, kwargs):
    """``zeros_like(x)``, ``ones_like(x)``, ``full_like(x, v)``: ``empty_like`` with the same
    keyword arguments (x's metadata only), then one fill kernel."""
    fill, fill_args = LIKE_FILLS[entry.op]
    out = run_op(aten.empty_like.default, (args[0],), kwargs)
    return run_op(fill, (out, *fill_args(args)), {})


def run_data_dependent(entry, args, kwargs):
    """An op whose output shape is data (``nonzero``, ``index`` of a mask): on the host,
    after a sync point; a host tensor indexed with device indices is refused first.
    ``index`` with integer indices alone (a gather, ``x[idx]``) has the shape of its
    indices: it is a kernel like any other (an index out of range fails on the queue)."""
    if entry.op is aten.index.Tensor and len(args) > 1 and not has_mask(args[1]):
        return recorder.record_kernel(entry, args, kwargs)
    if entry.op in INDEXING and args:
        refuse_device_indices_of_a_host_tensor(entry, args[0])
    for index, name in entry.mutated:  # an out= tensor on the host (nonzero(x, out=cpu)): CUDA's error
        target = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(target, torch.Tensor) and target.device.type != "neuron" and describe(args[0]) is not None:
            raise mismatch(entry, f"neuron:{current_index()}", target.device)
    return run_on_host(entry, args, kwargs, Flush.DATA_DEPENDENT)


_HANDLERS = {
    VIEW: lambda entry, args, kwargs: run_view(entry, args, kwargs),
    METADATA: lambda entry, args, kwargs: run_metadata(entry, args, kwargs),
    COPY: run_copy,
    HOST_READ: lambda entry, args, kwargs: run_on_host(entry, args, kwargs, Flush.HOST_READ),
    DATA_DEPENDENT: lambda entry, args, kwargs: run_data_dependent(entry, args, kwargs),
    COLLECTIVE: lambda entry, args, kwargs: run_collective(entry, args, kwargs),
    DECOMPOSE: decompose,
    LIKE: run_like,
    NO_OP: lambda entry, args, kwargs: None,
}


def install_native_recorder() -> bool:
    """Hand ``_C.record`` (``device/csrc/record.cpp``: ``recorder.record_kernel``'s common case, a
    kernel whose signature hits the shape cache, recorded in one C call) the objects it
    reads, live, as this module does. Not where this interpreter's frames cannot be read
    from C (``location.capture_location`` then walks frame objects). Returns whether it is
    installed; the registered kernels call it first (``backend._make_handler``).
    ``recorder.record_kernel`` is the reference for what it does."""
    if _native.user_frame(location.is_internal) is NotImplemented:
        return False
    _native.install_record({
        "shape_cache": shapes.SHAPE_CACHE, "inference_type": shapes.Inference, "queue": QUEUE,
        "counters": COUNTERS, "config": CONFIG, "sink_module": sink, "strict_sink": sink.STRICT_SINK,
        "profiler": PROFILER, "streams": STREAMS, "cow": COW, "op_record": op_record.OpRecord,
        "storage_type": DeviceStorage, "reference": tensor.reference, "view_ref": ViewRef,
        "is_internal": location.is_internal,
        "no_user_frame": location._no_user_frame, "new_storage": _native.new_storage, "empty": _native.empty,
        "guarded": op_record.GUARDED_WRITES, "recorder": recorder,
    })
    return True
