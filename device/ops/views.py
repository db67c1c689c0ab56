"""Views and in-place metadata changes: new metadata over an existing storage.

Entry points: :func:`run_view` (``view``, ``transpose``, ``select``, ``unbind``...),
:func:`run_metadata` (``t_``, ``unsqueeze_``, ``resize_``, ``set_``) and
:func:`set_metadata`. Neither launches a kernel. A view is what the CPU kernel of the op
makes of the neuron tensor: new sizes, strides and offset over the same storage (CPU
view kernels touch metadata only), so ``_base``, version counters and autograd's view
tracking are PyTorch's own. Kernels that read a view resolve it when they run
(``ViewRef``).
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..core.counters import COUNTERS
from ..core.errors import users_error
from ..core.reasons import Flush
from ..hardware import sink
from ..memory.storage import storage_nbytes
from ..memory.tensor import storage_of

aten = torch.ops.aten
_Tensor = torch.Tensor
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = aten.set_.source_Storage_storage_offset


def run_view(entry, args, kwargs):
    """A view: new metadata over the same storage, made by the op's CPU kernel. No data
    touched, no launch, no memory."""
    COUNTERS.count_view()
    try:
        return entry.op.redispatch(_CPU_KEYS, *args, **kwargs)
    except Exception as error:  # the CPU's own error for the user's arguments
        raise users_error(error)


_METADATA_SYNC = {aten.resize_.default, aten.resize_as_.default, aten.set_.source_Tensor, aten.set_.source_Storage,
                  aten.set_.source_Storage_storage_offset, aten.set_.default}


def set_metadata(tensor: torch.Tensor, untyped_storage, offset: int, shape, stride) -> None:
    """Point ``tensor`` at ``untyped_storage`` with these sizes, strides and offset (the
    CPU ``set_`` kernel: metadata only, once the storage is large enough)."""
    _set_storage.redispatch(_CPU_KEYS, tensor, untyped_storage, offset, list(shape), list(stride))


def deterministic_fill_value(dtype):
    """What ATen writes into fresh memory under ``torch.use_deterministic_algorithms(True)``
    with ``torch.utils.deterministic.fill_uninitialized_memory`` (its default): NaN for
    floating and complex dtypes, the largest value for the others (``True`` for bool;
    ATen's ``fill_empty_deterministic_``); None when that mode is off."""
    if not torch.are_deterministic_algorithms_enabled() or not torch.utils.deterministic.fill_uninitialized_memory:
        return None
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max


def _grow(tensor: torch.Tensor, nbytes: int) -> None:
    """Make ``tensor``'s storage at least ``nbytes`` long, keeping its bytes (as ATen grows
    a storage in ``resize_``)."""
    untyped = tensor.untyped_storage()
    if untyped.nbytes() >= nbytes:
        return
    if not untyped.resizable():  # a storage view (storage[a:b]): the CPU's error
        raise users_error(RuntimeError("Trying to resize storage that is not resizable"))
    _native.materialize_cow(tensor)  # a lazy clone's shared bytes are copied, not resized
    sink.synchronize(Flush.RESIZE)
    old_nbytes = untyped.nbytes()
    storage = storage_of(tensor)
    storage.resize_bytes(nbytes)
    _native.regrow(tensor, nbytes)
    fill = deterministic_fill_value(tensor.dtype)
    if fill is not None:  # the grown part, in the tensor's dtype (ATen's fill_resize_deterministic_)
        size = tensor.element_size()
        elements = storage.data[: nbytes // size * size].view(tensor.dtype)
        elements[old_nbytes // size:].fill_(fill)


def run_metadata(entry, args, kwargs):
    """In-place metadata changes (``t_``, ``unsqueeze_``, ``resize_``, ``set_``).

    Pure metadata changes run the CPU kernel on the tensor. ``resize_`` may grow the
    storage, ``set_`` re-points the tensor at another one: they wait for the device.
    """
    tensor = args[0]
    op = entry.op
    COUNTERS.count_view()
    if op not in _METADATA_SYNC:
        try:
            op.redispatch(_CPU_KEYS, *args, **kwargs)
        except Exception as error:  # the CPU's own error for the user's arguments
            raise users_error(error)
        return tensor
    if op is aten.resize_.default or op is aten.resize_as_.default:
        size = args[1].shape if op is aten.resize_as_.default else args[1]
        memory_format = kwargs.get("memory_format") or (args[2] if len(args) > 2 else None)
        probe = torch.empty(0, dtype=tensor.dtype, device="meta").as_strided(tensor.shape, tensor.stride())
        probe = probe.resize_(size, memory_format=memory_format) if memory_format is not None else probe.resize_(size)
        shape, stride = tuple(probe.shape), tuple(probe.stride())
        offset = tensor.storage_offset()
        needed = (storage_nbytes(shape, stride, 1) + offset) * tensor.element_size() if probe.numel() else 0
        _grow(tensor, needed)
        set_metadata(tensor, tensor.untyped_storage(), offset, shape, stride)
        return tensor
    sink.synchronize(Flush.METADATA.of(entry.name))
    if op is aten.set_.default:  # set_(): an empty storage of the device
        from ..memory.storage import DeviceStorage
        from ..memory.tensor import device_tensor

        fresh = device_tensor((0,), (1,), tensor.dtype, DeviceStorage((0,), (1,), tensor.dtype, 0), 0)
        set_metadata(tensor, fresh.untyped_storage(), 0, (0,), (1,))
        return tensor
    if op is aten.set_.source_Tensor:
        source = args[1]
        set_metadata(tensor, source.untyped_storage(), source.storage_offset(), source.shape, source.stride())
        return tensor
    untyped = args[1]
    offset = args[2] if len(args) > 2 else kwargs.get("storage_offset", 0)
    shape = args[3] if len(args) > 3 else kwargs.get("size", (untyped.nbytes() // tensor.element_size(),))
    stride = args[4] if len(args) > 4 else kwargs.get("stride")
    if stride is None or len(stride) == 0:
        stride = torch.empty(shape, device="meta").stride()
    if untyped.device.type != "neuron":
        raise RuntimeError(
            f"Attempted to set the storage of a tensor on device \"{tensor.device}\" to a storage on different "
            f"device \"{untyped.device}\". This is no longer allowed; the devices must match."
        )
    needed = (storage_nbytes(tuple(shape), tuple(stride), 1) + offset) * tensor.element_size() if all(shape) else 0
    if untyped.nbytes() < needed:  # the CPU's set_ grows the storage (resize_impl_cpu_)
        set_metadata(tensor, untyped, 0, (0,), (1,))
        _grow(tensor, needed)
    set_metadata(tensor, untyped, offset, shape, stride)
    return tensor
