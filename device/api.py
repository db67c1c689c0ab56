"""``torch.neuron``: the device module, mirroring the ``torch.cuda`` names that apply.

Registered as ``torch.neuron`` by ``device.backend.register``. Devices ``neuron:0`` ..
``neuron:<device_count()-1>``, one per simulated NeuronCore (``device/memory/indices.py``); they
share one execution queue, so memory statistics and random state are the process's,
whichever index is asked. Every function here that reads device state is a sync point
where CUDA's is.
"""
from __future__ import annotations

import torch

from .core.config import CONFIG
from .core.reasons import Flush
from .hardware.cost_model import PROFILE
from .hardware.sink import synchronize as _synchronize
from .hardware.streams import Event, Stream, current_stream, default_stream, set_stream, stream  # noqa: F401
from .memory.indices import COUNT, current_index, exchange_index, index_of
from .memory.legacy_storage import CLASSES as _LEGACY_STORAGES
from .memory.storage import MEMORY, release_freed_memory
from .ops import rng as _random

# -- device ------------------------------------------------------------------------------


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    pass


def device_count() -> int:
    """The simulated NeuronCores this process sees (``NEURON_SIM_CORES``, else torchrun's
    ``LOCAL_WORLD_SIZE``, else 1)."""
    return COUNT


def current_device() -> int:
    """The calling thread's device index (torchrun's ``LOCAL_RANK`` until it sets one)."""
    return current_index()


def _check_index(device) -> int:
    """The index ``device`` names (None: the current device); raises past the count."""
    return index_of(device)


def set_device(device) -> None:
    """Make ``device`` the calling thread's current device, as ``torch.cuda.set_device``."""
    exchange_index(_check_index(device))


class device:
    """``with torch.neuron.device(i):`` runs the block with ``neuron:i`` current."""

    def __init__(self, device) -> None:
        self.index = -1 if device is None or (isinstance(device, int) and device < 0) else _check_index(device)
        self.previous = -1

    def __enter__(self):
        if self.index >= 0:
            self.previous = exchange_index(self.index)
        return self

    def __exit__(self, *exc) -> bool:
        if self.index >= 0:
            exchange_index(self.previous)
        return False


class device_of(device):
    """``with torch.neuron.device_of(tensor):``: the tensor's device current (no-op for a
    host tensor)."""

    def __init__(self, obj) -> None:
        super().__init__(obj.get_device() if obj.device.type == "neuron" else -1)


def get_device_name(device=None) -> str:
    _check_index(device)
    return PROFILE.name


def get_device_properties(device=None):
    _check_index(device)
    return PROFILE


def get_device_capability(device=None):
    _check_index(device)
    return (2, 0)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype():
    return [torch.bfloat16, torch.float16]


def synchronize(device=None) -> None:
    """Wait for every kernel issued so far; rethrow the earliest deferred error."""
    _check_index(device)
    _synchronize(Flush.SYNCHRONIZE)


# -- random ------------------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    _random.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    _random.manual_seed(seed)


def seed() -> None:
    _random.seed()


def seed_all() -> None:
    _random.seed()


def initial_seed() -> int:
    return _random.initial_seed()


def get_rng_state(device="neuron") -> torch.Tensor:
    _check_index(device)
    return _random.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device="neuron") -> None:
    _check_index(device)
    _random.set_rng_state(new_state)


def get_rng_state_all() -> list:
    """One state per index: the indices share one random stream (device/memory/indices.py)."""
    state = _random.get_rng_state()
    return [state.clone() for _ in range(COUNT)]


def set_rng_state_all(new_states) -> None:
    _random.set_rng_state(new_states[0])


# -- memory ------------------------------------------------------------------------------


def memory_allocated(device=None) -> int:
    _check_index(device)
    return MEMORY.allocated


def max_memory_allocated(device=None) -> int:
    _check_index(device)
    return MEMORY.peak


def memory_reserved(device=None) -> int:
    _check_index(device)
    return MEMORY.reserved


def max_memory_reserved(device=None) -> int:
    _check_index(device)
    return max(MEMORY.reserved, MEMORY.peak)


def reset_peak_memory_stats(device=None) -> None:
    _check_index(device)
    MEMORY.peak = MEMORY.allocated


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def empty_cache() -> None:
    """Return cached, unused blocks: reserved memory falls to what is allocated."""
    MEMORY.reserved = MEMORY.allocated
    release_freed_memory()


def mem_get_info(device=None) -> tuple[int, int]:
    _check_index(device)
    return CONFIG.hbm_bytes - MEMORY.reserved, CONFIG.hbm_bytes


def memory_stats(device=None) -> dict:
    _check_index(device)
    return {
        "allocated_bytes.all.current": MEMORY.allocated,
        "allocated_bytes.all.peak": MEMORY.peak,
        "reserved_bytes.all.current": MEMORY.reserved,
        "allocation.all.allocated": MEMORY.allocations,
        "allocation.all.freed": MEMORY.frees,
        "allocation.all.current": MEMORY.live_blocks,
        "num_ooms": MEMORY.ooms,
        "capacity_bytes": CONFIG.hbm_bytes,
    }


def memory_summary(device=None, abbreviated: bool = False) -> str:
    stats = memory_stats(device)
    mib = 1 << 20
    devices = "neuron:0" if COUNT == 1 else f"neuron:0..{COUNT - 1} (aggregated)"
    lines = [
        f"{devices} memory summary (simulated HBM)",
        f"  capacity:         {stats['capacity_bytes'] / mib:12.1f} MiB",
        f"  allocated:        {stats['allocated_bytes.all.current'] / mib:12.1f} MiB"
        f" in {stats['allocation.all.current']} blocks",
        f"  peak allocated:   {stats['allocated_bytes.all.peak'] / mib:12.1f} MiB",
        f"  reserved:         {stats['reserved_bytes.all.current'] / mib:12.1f} MiB",
        f"  allocations:      {stats['allocation.all.allocated']:12d}",
        f"  frees:            {stats['allocation.all.freed']:12d}",
        f"  out-of-memory:    {stats['num_ooms']:12d}",
    ]
    return "\n".join(lines)


# -- legacy storage classes (device/memory/legacy_storage.py) ------------------------------------
# torch.neuron.FloatStorage and the rest, which tensor.storage_type() finds here
globals().update(_LEGACY_STORAGES)
