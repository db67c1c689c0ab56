"""Views and in-place metadata changes: new metadata over an existing storage.

Entry points: :func:`run_view` (``view``, ``transpose``, ``select``, ``unbind``...) and
:func:`run_metadata` (``t_``, ``unsqueeze_``, ``resize_``, ``set_``). Neither launches a
kernel. A view's metadata comes from a meta run cached per view signature, and its tensor
holds a :class:`ViewRef` into the base's storage, resolved only when a kernel runs.
"""
from __future__ import annotations

import torch

from . import sync as _sync
from .host_ops import host_call_args
from .metrics import COUNTERS
from .storage import ViewRef, storage_nbytes
from .tensor import NeuronTensor, cpu_view, set_wrapper_metadata, wrap_view

aten = torch.ops.aten
_Tensor = torch.Tensor

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
    if base.dtype is not storage.dtype or type(base._ref) is _Tensor:
        return _host_view(entry, storage, args, kwargs)  # a view of a reinterpreting view
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
    host_args, host_kwargs = host_call_args(entry, args, kwargs)
    result = entry.op(*host_args, **host_kwargs)
    views = (result,) if isinstance(result, _Tensor) else tuple(result)
    wrapped = []
    for view in views:
        tensor = wrap_view(storage, tuple(view.shape), tuple(view.stride()), view.storage_offset(), view.dtype)
        tensor._ref = view  # a CPU tensor over the storage's bytes
        # The wrapper carries the view's conjugate/negative bits, as a CPU or CUDA tensor
        # does: composite ops read them (``real`` of a conjugate, ``resolve_conj``), and
        # ops without math-bit support get the bits resolved by ATen's fallback first.
        if view.is_conj():
            torch._C._set_conj(tensor, True)
        if view.is_neg():
            torch._C._set_neg(tensor, True)
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
    host_args, host_kwargs = host_call_args(entry, args[1:], kwargs)
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
