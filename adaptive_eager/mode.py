"""Switching between strict and adaptive eager.

Entry points: :func:`enable`, :func:`disable`, :func:`is_enabled` and the context manager
:func:`mode` (``with adaptive_eager.mode(True): ...``). ``NEURON_ADAPTIVE_EAGER=1`` enables
adaptive eager at start-up. Switching flushes the window, so no recorded op is lost and
no fused kernel spans the switch.
"""
from __future__ import annotations

import contextlib

from adaptive_eager_device import sync as _sync

_ADAPTIVE = {"sink": None}


def _adaptive_sink():
    sink = _ADAPTIVE["sink"]
    if sink is None:
        from adaptive_eager_device.backend import freeze_import_time_objects
        from .window import AdaptiveSink

        sink = _ADAPTIVE["sink"] = AdaptiveSink()
        freeze_import_time_objects()  # the planner's imports (networkx) are long-lived too
    return sink


def enable() -> None:
    """Adaptive eager from now on: ops are buffered in a window and fused."""
    _sync.set_sink(_adaptive_sink())


def disable() -> None:
    """Strict eager from now on: one op, one kernel launch."""
    _sync.set_sink(_sync.STRICT_SINK)


def is_enabled() -> bool:
    return _sync.current_sink().name == "adaptive"


@contextlib.contextmanager
def mode(adaptive: bool = True):
    """Run a region in adaptive (``True``) or strict (``False``) eager, then restore."""
    previous = is_enabled()
    enable() if adaptive else disable()
    try:
        yield
    finally:
        enable() if previous else disable()
