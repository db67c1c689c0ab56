"""Device indices: ``neuron:0`` .. ``neuron:<count-1>``, one per simulated NeuronCore.

Entry points: :data:`COUNT`, :data:`MULTI`, :func:`current_index`, :func:`index_of`,
:func:`check_ordinal` and :func:`invalid_ordinal`. The per-op device guard, which picks
an op's device from its arguments, is ``ops/device_guard.py``.

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
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..core.config import CONFIG
from ..core.errors import users_error

COUNT = CONFIG.device_count
MULTI = COUNT > 1

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
