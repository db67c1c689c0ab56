"""Copy-on-write lazy clones (``torch._lazy_clone``), as the CPU makes them.

Entry points: :func:`lazy_clone` (the PrivateUse1 kernel of ``aten::_lazy_clone``),
:func:`materialize_written` (the dispatcher calls it for each op that writes, once a lazy
clone exists), :func:`copy_shared` (the C++ side's copy of shared bytes) and :data:`COW`.

A lazy clone is a second storage over the same allocation, through c10's own
copy-on-write context (``device/csrc/cow.cpp``), so ``torch._C._is_cow_tensor`` is true for
both tensors, their ``_data_address`` is the same and their ``_storage_address`` differs,
as on the CPU; nothing runs and no byte moves. Reads of either read the shared bytes (the
same ``DeviceStorage``). Before an op writes a tensor whose storage is copy-on-write, that
storage gives up its share: the last share takes the allocation back (no copy), any other
gets a fresh allocation and a clone kernel issued now, in program order, so the copy holds
every write issued before it (queued in strict eager or waiting in an adaptive window)
and none after. c10 calls the same materialization for ``data_ptr()``, as on the CPU.
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..hardware.execution_queue import HOST_LOCK
from .op_table import METADATA, op_entry

aten = torch.ops.aten


class _CowState:
    """``live``: whether a lazy clone was ever made on the device. Until then the
    dispatcher skips :func:`materialize_written` (one attribute test per writing op)."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = False


COW = _CowState()
_materialize = _native.materialize_cow


def lazy_clone(tensor: torch.Tensor) -> torch.Tensor:
    """``aten::_lazy_clone`` of a neuron tensor: the same metadata over a new storage
    sharing the tensor's allocation copy-on-write (``device/csrc/cow.cpp``)."""
    with HOST_LOCK:
        COW.live = True
        return _native.lazy_clone(tensor)


def copy_shared(tensor: torch.Tensor) -> torch.Tensor:
    """A clone kernel of ``tensor`` (a neuron tensor over a whole shared allocation),
    issued now: the copy a storage takes when it gives up its share before a write."""
    from .recorder import record_kernel  # recorder imports nothing of this module

    with HOST_LOCK:
        return record_kernel(op_entry(aten.clone.default), (tensor,), {})


def materialize_written(entry, args, kwargs) -> None:
    """Before ``entry``'s op writes: each neuron tensor it writes whose storage is
    copy-on-write gives up its share. Metadata changes write no data (``resize_`` that
    grows a storage gives it up in ``views._grow``)."""
    if entry.kind is METADATA:
        return
    for index, name in entry.mutated:
        value = args[index] if index < len(args) else (kwargs or {}).get(name)
        if type(value) is list or type(value) is tuple:
            for item in value:
                _materialize(item)
        elif value is not None:
            _materialize(value)

