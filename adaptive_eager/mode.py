"""Switching between strict and adaptive eager.

Entry points: :func:`enable`, :func:`disable`, :func:`is_enabled` and the context manager
:func:`mode` (``with adaptive_eager.mode(True): ...``). ``NEURON_ADAPTIVE_EAGER=1`` enables
adaptive eager at start-up. Switching flushes the window, so no recorded op is lost and
no fused kernel spans the switch.

The window's thresholds are public too: :func:`window_policy` changes them for a region
(tests and benchmarks pin windows to sync points, or switch the pattern library or the
on-chip rule off) and :func:`clear_caches` empties the plan and kernel caches (a cold
start).
"""
from __future__ import annotations

import contextlib

from adaptive_eager_device.hardware import sink

_ADAPTIVE = {"sink": None}


def _adaptive_sink():
    window = _ADAPTIVE["sink"]
    if window is None:
        from adaptive_eager_device.backend import freeze_import_time_objects
        from .window import AdaptiveSink

        window = _ADAPTIVE["sink"] = AdaptiveSink()
        freeze_import_time_objects()  # the planner's imports (networkx) are long-lived too
    return window


def enable() -> None:
    """Adaptive eager from now on: ops are buffered in a window and fused."""
    sink.set_sink(_adaptive_sink())


def disable() -> None:
    """Strict eager from now on: one op, one kernel launch."""
    sink.set_sink(sink.STRICT_SINK)


def is_enabled() -> bool:
    return sink.current_sink().name == "adaptive"


@contextlib.contextmanager
def mode(adaptive: bool = True):
    """Run a region in adaptive (``True``) or strict (``False``) eager, then restore."""
    previous = is_enabled()
    enable() if adaptive else disable()
    try:
        yield
    finally:
        enable() if previous else disable()


@contextlib.contextmanager
def window_policy(**fields):
    """Set fields of adaptive eager's window policy for a region, then restore them all;
    yields the live policy. Fields: ``max_ops`` and ``min_ops`` (window size bounds),
    ``shallow_us`` (flush when the device's backlog falls below it), ``patterns`` (the
    pattern library), ``on_chip_bytes`` (the on-chip rule's budget, 0 turns it off),
    ``policy`` (``"ours"`` or ``"torchneuron"``, ``adaptive_eager/policies.py``); each
    is a ``NEURON_ADAPTIVE_*`` value of the configuration (``WindowPolicy.FIELDS``). A
    change applies from the next op the window records; no flush is forced."""
    from adaptive_eager_device.core.config import CONFIG

    from .window import WindowPolicy

    unknown = sorted(set(fields) - set(WindowPolicy.FIELDS))
    if unknown:
        raise TypeError(f"window_policy: no field {', '.join(unknown)}; the fields are "
                        f"{', '.join(sorted(WindowPolicy.FIELDS))}")
    saved = {name: getattr(CONFIG, attribute) for name, attribute in WindowPolicy.FIELDS.items()}
    for name, value in fields.items():
        setattr(CONFIG, WindowPolicy.FIELDS[name], value)
    try:
        yield _adaptive_sink().policy
    finally:
        for name, value in saved.items():
            setattr(CONFIG, WindowPolicy.FIELDS[name], value)


def clear_caches() -> None:
    """Empty adaptive eager's plan cache and kernel cache: the next windows plan and build
    their kernels afresh, as in a new process."""
    window = _adaptive_sink()
    window.plan_cache.clear()
    window.kernel_cache.clear()
