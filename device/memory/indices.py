"""Device indices: ``neuron:0`` .. ``neuron:<count-1>``, one per simulated NeuronCore.

Entry points: :data:`COUNT`, :data:`MULTI`, :func:`current_index`, :func:`check_ordinal`,
:func:`invalid_ordinal`, :func:`on_its_device` (the per-op device guard) and
:func:`mismatch`.

The model, as on a Trainium host: every NeuronCore of the host is visible to every
process, and torchrun gives each process its local rank's core. So the count is
``NEURON_SIM_CORES``, else torchrun's ``LOCAL_WORLD_SIZE``, else 1 (``config.py``), and a
thread's current device starts at ``LOCAL_RANK`` (0 outside torchrun). The current device
is per thread, as CUDA's; it lives in the C++ hooks (``csrc/memory.cpp``), and ``csrc/hooks.cpp``
registers the device guard c10 and the autograd engine switch devices with.

Every index of a process shares the process's one simulated execution queue, memory
accounting and random stream: an index is where a tensor lives (its storage's DataPtr,
its ``.device``), which ops check, not a separate engine. ``torch.neuron`` memory
statistics are aggregated over the indices.

Each op runs on one device, as CUDA's kernels run under the device guard of their
arguments (:func:`op_index`): its ``device=`` argument when it has one (the current
device for a bare ``neuron``), else its neuron tensors' index, which must agree (copies
may cross indices: ``x.to("neuron:1")`` is a device copy), else the current device. Its
outputs are allocated there. With one device (the common case) none of this runs on the
per-op path.
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..core.config import CONFIG
from ..core.errors import users_error
from ..ops.op_table import COPY

COUNT = CONFIG.device_count
MULTI = COUNT > 1
_Tensor = torch.Tensor

current_index = _native.current_device
exchange_index = _native.exchange_device


def invalid_ordinal(device) -> RuntimeError:
    """``neuron:<n>`` with n at or above the count: raise as CUDA does."""
    devices = "neuron:0 (or 'neuron') is the only device" if COUNT == 1 else (
        f"neuron:0 .. neuron:{COUNT - 1} (or 'neuron', the current one) are the devices")
    return users_error(RuntimeError(
        f"neuron error: invalid device ordinal: {device} does not exist; the neuron device count is {COUNT}, "
        f"so {devices}"))


def check_ordinal(device) -> None:
    """Raise :func:`invalid_ordinal` for a ``torch.device('neuron', n)`` out of range."""
    index = device.index
    if index is not None and index >= COUNT:
        raise invalid_ordinal(device)


def index_of(device) -> int:
    """The index ``device`` (an index, a ``torch.device`` or a string, None for the current
    device) names, checked against the count."""
    if device is None:
        return current_index()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        if device.index is None:
            return current_index()
        check_ordinal(device)
        return device.index
    index = int(device)
    if not 0 <= index < COUNT:
        raise invalid_ordinal(f"neuron:{index}")
    return index


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
    :func:`mismatch` when its neuron tensors disagree, :func:`invalid_ordinal` for a
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
