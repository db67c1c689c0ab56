"""Environment switches of the simulated device, read once at import.

Every variable starts with ``NEURON_``. Tests and benchmarks change the live values
through :data:`CONFIG` (``CONFIG.launch_blocking = True``), never by editing
``os.environ`` after import.

| variable                   | meaning                                                    |
| -------------------------- | ---------------------------------------------------------- |
| NEURON_LAUNCH_BLOCKING=1   | every op runs synchronously and raises at the faulty op    |
| NEURON_FALLBACK=0          | an op the device lacks raises instead of running on the CPU |
| NEURON_FULL_STACK=1        | keep the whole Python stack of every op (slow; debugging)  |
| NEURON_SIM_HBM_GB=<float>  | device memory capacity, GiB (default: one Trn2 chip, 96)   |
| NEURON_SIM_FAULT=op:n[,..] | fault injection: the n-th kernel running ``op`` fails      |
| NEURON_TRACE=<path.json>   | write a Chrome trace of host issue and device execution   |
| NEURON_GC_FREEZE=0         | do not freeze import-time objects out of the cyclic GC     |
"""
from __future__ import annotations

import os


def env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number") from exc


class DeviceConfig:
    """Live switches. Attribute reads are on the per-op path, so this is a plain object."""

    __slots__ = ("launch_blocking", "fallback", "full_stack", "hbm_bytes", "trace_path")

    def __init__(self) -> None:
        self.launch_blocking = env_flag("NEURON_LAUNCH_BLOCKING")
        self.fallback = env_flag("NEURON_FALLBACK", True)
        self.full_stack = env_flag("NEURON_FULL_STACK")
        self.hbm_bytes = int(env_float("NEURON_SIM_HBM_GB", 96.0) * (1 << 30))
        self.trace_path = os.environ.get("NEURON_TRACE") or None


CONFIG = DeviceConfig()
