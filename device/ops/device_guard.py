"""The per-op device guard: which device index an op runs on, and CUDA's error when its
tensors disagree.

Entry points: :func:`on_its_device` (wraps the per-op entry when there are several
devices), :func:`op_index` and :func:`mismatch`.

Each op runs on one device, as CUDA's kernels run under the device guard of their
arguments (:func:`op_index`): its ``device=`` argument when it has one (the current
device for a bare ``neuron``), else its neuron tensors' index, which must agree (copies
may cross indices: ``x.to("neuron:1")`` is a device copy), else the current device. Its
outputs are allocated there. With one device (the common case) none of this runs on the
per-op path. The indices themselves (count, current device, ordinals) are
``memory/indices.py``.
"""
from __future__ import annotations

import torch

from ..core.errors import users_error
from ..memory.indices import current_index, exchange_index, index_of
from .op_table import COPY

_Tensor = torch.Tensor


class DeviceMismatchError(RuntimeError):
    pass


def mismatch(entry, device, other) -> DeviceMismatchError:
    """CUDA's error for an op given tensors on two devices."""
    return users_error(DeviceMismatchError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{device} and {other}! (when checking arguments for {entry.name})"
    ))


def _tensor_index(entry, value, found: int) -> int:
    """``found`` (-1: none yet) after meeting ``value``: a neuron tensor's index (the only
    accelerator in the process, so ``get_device() >= 0`` means neuron), lists walked."""
    kind = type(value)
    if kind is list or kind is tuple:
        for item in value:
            found = _tensor_index(entry, item, found)
        return found
    if not isinstance(value, _Tensor):
        return found
    index = value.get_device()
    if index < 0 or index == found:
        return found
    if found < 0 or entry.kind is COPY:  # copies may cross indices: the first one's device
        return found if found >= 0 else index
    raise mismatch(entry, f"neuron:{found}", f"neuron:{index}")


def op_index(entry, args, kwargs) -> int:
    """The device the op of ``entry`` runs on (see the module docstring); raises
    :func:`mismatch` when its neuron tensors disagree, ``indices.invalid_ordinal`` for a
    ``device=`` out of range. On the per-op path when there are several devices."""
    if kwargs:
        device = kwargs.get("device")
        if type(device) is torch.device and device.type == "neuron":
            return index_of(device)
    found = -1
    for value in args:
        found = _tensor_index(entry, value, found)
    if kwargs:
        for value in kwargs.values():
            found = _tensor_index(entry, value, found)
    return current_index() if found < 0 else found


def on_its_device(run):
    """``run(entry, args, kwargs)`` under the device guard of the op: its outputs (and
    every storage allocated meanwhile) live on its device."""

    def run_on_index(entry, args, kwargs):
        index = op_index(entry, args, kwargs)
        previous = exchange_index(index)
        try:
            return run(entry, args, kwargs)
        finally:
            if previous != index:
                exchange_index(previous)

    return run_on_index
