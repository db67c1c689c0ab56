"""Every ``NEURON_*`` environment variable, parsed and checked in one place, once, at import.

Entry points: :data:`CONFIG` (the live values) and :data:`VARIABLES` (the table: name,
type, default, meaning). Every module reads its values from ``CONFIG`` when it uses them,
never a copy made at import, so tests and benchmarks change a live value through
``CONFIG`` (``CONFIG.launch_blocking = True``), never by editing ``os.environ`` after
import. Two values are the process's for good once the device is registered: the device
count (the C++ hooks hold it, as CUDA reads ``CUDA_VISIBLE_DEVICES`` once), the
device's first current index, and the logical-core configuration ``NEURON_SIM_LNC`` (the
device profile, ``device/hardware/cost_model.py``, and the costs cached per op signature
follow it; the Neuron runtime too reads its ``NEURON_LOGICAL_NC_CONFIG`` once).

A bad value never breaks ``import torch`` (the device registers on every ``import torch``,
also in programs that never use it): it is recorded in :data:`CONFIG.errors`, the default
stands in, and the device's first use raises one line naming the variable, the value and
what is allowed (``device/backend.py``). Programs that never touch ``neuron`` are
unaffected.
"""
from __future__ import annotations

import logging
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected 1 or 0 (also true/false, yes/no, on/off)")


def _number(low: float, strict: bool, kind=float):
    def parse(text: str):
        try:
            value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None
        if value < low or (strict and value == low):
            raise ValueError(f"expected a number {'>' if strict else '>='} {low:g}")
        return value

    return parse


def parse_log_level(text: str) -> int:
    """``"debug"``, ``"DEBUG"`` or ``"10"`` -> 10; ValueError for anything else."""
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise ValueError("expected DEBUG, INFO, WARNING, ERROR, CRITICAL or a number")
    return level


def parse_fault_spec(text: str) -> tuple:
    """``aten::mul:3,aten::add:1`` -> (("aten::mul", 3), ("aten::add", 1))."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, nth = item.rpartition(":")
        if not name or not nth.isdigit() or int(nth) < 1:
            raise ValueError("expected op:n[,op:n...], e.g. aten::mul:3 (the 3rd mul kernel fails)")
        faults.append((name if "::" in name else "aten::" + name, int(nth)))
    return tuple(faults)


def _text(text: str) -> str:
    return text


def _choice(*allowed):
    def parse(text: str):
        for value in allowed:
            if text.lower() == str(value).lower():
                return value
        raise ValueError("expected " + " or ".join(str(value) for value in allowed))

    return parse


def default_hbm_gb(lnc: int) -> float:
    """One logical NeuronCore's share of a Trainium2 chip's 96 GiB of HBM: 24 GiB at LNC=2
    (one of the chip's four 24 GB banks, shared by its two physical cores), 12 GiB at
    LNC=1 (half a bank); ``device/hardware/cost_model.py`` cites the figures."""
    return 96.0 * lnc / 8


MAX_CORES = 64  # device indices a process may see (one Trn2 node's logical NeuronCores)


def parse_cores(text: str) -> int:
    """``"4"`` -> 4: the simulated NeuronCores one process sees (1..64)."""
    cores = _number(1, False, int)(text)
    if cores > MAX_CORES:
        raise ValueError(f"expected at most {MAX_CORES}")
    return cores


def _torchrun_count(text: str) -> int | None:
    """torchrun's ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` as an int, or None when absent or not
    an integer (they are torchrun's, not ours to refuse)."""
    text = text.strip()
    return int(text) if text.isdigit() else None


# (variable, attribute, parse, default, meaning); README's table mirrors this one.
VARIABLES = (
    ("NEURON_ADAPTIVE_EAGER", "adaptive", _flag, False, "adaptive eager at start-up (default: strict eager)"),
    ("NEURON_ADAPTIVE_WINDOW", "window_ops", _number(1, False, int), 128, "most ops a window holds"),
    ("NEURON_ADAPTIVE_MIN_WINDOW", "min_window_ops", _number(1, False, int), 16,
     "ops a window holds before the policy may flush it early"),
    ("NEURON_ADAPTIVE_SHALLOW_US", "shallow_us", _number(0, False), 20.0,
     "simulated device backlog at or below which the device counts as starved"),
    ("NEURON_ADAPTIVE_PATTERNS", "patterns", _flag, True,
     "match the pattern library's chains: each runs as one library kernel"),
    ("NEURON_NATIVE", "native", _flag, True,
     "the device worker runs kernels in C++ (0: every kernel through Python, the reference path)"),
    ("NEURON_COMPILED_REPLAY", "compiled_replay", _flag, True,
     "replay a compiled graph's recorded launches for calls of the same input signature"),
    ("NEURON_COMPILED_INDUCTOR", "compiled_inductor", _flag, True,
     "compiled mode runs its fused kernels as code Inductor generates for the CPU, compiled in the background "
     "(0: their ops one by one, as adaptive eager does)"),
    ("NEURON_ADAPTIVE_ON_CHIP_MB", "on_chip_mb", _number(0, False), 28.0,
     "working set under which any ops may fuse (one NeuronCore-v3's SBUF, 28 MiB; 0 turns the rule off)"),
    ("NEURON_ADAPTIVE_POLICY", "adaptive_policy", _choice("ours", "torchneuron"), "ours",
     "adaptive eager's rules: ours, or TorchNeuron's own (regions closed at matmuls, broken by in-place ops)"),
    ("NEURON_SIM_HOST_US", "host_us_per_op", _number(0, False), 5.0, "simulated host cost of issuing one op"),
    ("NEURON_SIM_LAUNCH_US", "launch_us", _number(0, False), 10.0, "simulated launch overhead per kernel"),
    ("NEURON_SIM_LINK_GBPS", "link_gbps", _number(0, True), 100.0, "simulated inter-chip link bandwidth"),
    ("NEURON_SIM_LNC", "lnc", _choice(1, 2), 2,
     "physical NeuronCore-v3 per device (Trn2's logical NeuronCore config, LNC): 2 or 1"),
    ("NEURON_SIM_HBM_GB", "hbm_gb", _number(0, True), None,
     "simulated device memory in GiB (default: one logical core's share of a Trn2 chip, 24 at LNC=2, 12 at LNC=1)"),
    ("NEURON_SIM_CORES", "cores", parse_cores, None,
     "simulated NeuronCores each process sees, neuron:0..n-1 (default: LOCAL_WORLD_SIZE under torchrun, else 1)"),
    ("NEURON_SIM_FAULT", "faults", parse_fault_spec, (), "fault injection: aten::mul:3 makes the 3rd mul kernel fail"),
    ("NEURON_TRACE", "trace_path", _text, None, "write a Chrome trace of host issue and device execution"),
    ("NEURON_FUSION_STATS", "stats_path", _text, None, "write the statistics as JSON at exit"),
    ("NEURON_LAUNCH_BLOCKING", "launch_blocking", _flag, False, "run every op synchronously; errors raise at the op"),
    ("NEURON_FALLBACK", "fallback", _flag, True, "run ops the device lacks on the CPU (0: raise instead)"),
    ("NEURON_FULL_STACK", "full_stack", _flag, False, "keep the full Python stack of every op for deferred errors, and the device's frames "
     "and chained errors (the meta kernel's rejection) in errors raised at once"),
    ("NEURON_LOG_LEVEL", "log_level", parse_log_level, None, "print the adaptive_eager loggers at this level to stderr"),
)


class DeviceConfig:
    """Live values. Attribute reads are on the per-op path, so this is a plain object."""

    # hbm_gb is a property over _hbm_gb, keeping _hbm_bytes, which the C recorder reads per op
    __slots__ = tuple(attribute for _, attribute, _, _, _ in VARIABLES if attribute != "hbm_gb") + (
        "_hbm_gb", "_hbm_bytes", "errors", "local_world_size", "local_rank")

    def __init__(self, environ=None) -> None:
        environ = os.environ if environ is None else environ
        self.errors = []  # one line per bad value; the device's first use raises them
        for variable, attribute, parse, default, _ in VARIABLES:
            text = environ.get(variable, "").strip()
            value = default
            if text:
                try:
                    value = parse(text)
                except ValueError as error:
                    self.errors.append(f"{variable}={text!r} is not valid: {error}")
            setattr(self, attribute, value)
        if self.hbm_gb is None:
            self.hbm_gb = default_hbm_gb(self.lnc)
        self.local_world_size = _torchrun_count(environ.get("LOCAL_WORLD_SIZE", ""))
        self.local_rank = _torchrun_count(environ.get("LOCAL_RANK", ""))
        if self.cores is None and (self.local_world_size or 0) > MAX_CORES:
            self.errors.append(f"LOCAL_WORLD_SIZE={self.local_world_size} asks for more than {MAX_CORES} simulated "
                               "NeuronCores per process; set NEURON_SIM_CORES")

    @property
    def device_count(self) -> int:
        """The device indices this process sees: ``NEURON_SIM_CORES``, else torchrun's
        ``LOCAL_WORLD_SIZE`` (every NeuronCore of the host is visible to every process, as
        on a Trainium host), else 1. Fixed at import (the C++ hooks hold it)."""
        if self.cores is not None:
            return self.cores
        return min(max(self.local_world_size or 1, 1), MAX_CORES)

    @property
    def initial_device(self) -> int:
        """The current device of every thread until it sets one: torchrun's ``LOCAL_RANK``
        (each process starts on its local rank's core) when it is a valid index, else 0."""
        rank = self.local_rank
        return rank if rank is not None and rank < self.device_count else 0

    @property
    def hbm_gb(self) -> float | None:
        return self._hbm_gb

    @hbm_gb.setter
    def hbm_gb(self, value) -> None:
        self._hbm_gb = value
        self._hbm_bytes = None if value is None else int(value * (1 << 30))

    @property
    def hbm_bytes(self) -> int:
        return self._hbm_bytes

    @hbm_bytes.setter
    def hbm_bytes(self, value: int) -> None:
        self.hbm_gb = value / (1 << 30)

    @property
    def on_chip_bytes(self) -> int:
        return int(self.on_chip_mb * (1 << 20))

    @on_chip_bytes.setter
    def on_chip_bytes(self, value: int) -> None:
        self.on_chip_mb = value / (1 << 20)

    def problem(self) -> str | None:
        """What the device's first use raises, or None when every value is valid."""
        if not self.errors:
            return None
        return "; ".join(self.errors) + " (the neuron device reads NEURON_* variables at import)"


CONFIG = DeviceConfig()
