"""Counters of the device layer: what reached the device and what the queue ran.

Entry point: :data:`COUNTERS`. Each field has one writer: host-side fields are written
by the thread issuing ops, queue-side fields by the device worker. The adaptive runtime
keeps its own counters and merges both into the statistics contract
(``adaptive_eager.stats()``).
"""
from __future__ import annotations

from collections import Counter

from .. import _C as _native

# views made by the C++ view kernels (device/csrc/views.cpp), which never enter Python;
# a _C built before them has none
_native_views = getattr(_native, "view_count", lambda: 0)


class DeviceCounters:
    __slots__ = (
        # host side
        "ops_recorded",  # aten ops that reached the device, views excluded
        "_python_views",  # metadata-only ops run in Python (views.py); view_ops adds C++'s
        "_native_views_at_reset",
        "kernels_launched",  # launches submitted to the execution queue
        "fallback_ops",  # Counter: aten::name -> runs on the CPU fallback
        "sync_points",  # Counter: reason -> host waits for the queue
        "launches_by_stream",  # dict: stream id -> launches
        "collectives",  # Counter: c10d::op -> calls
        "collective_totals",  # dict: c10d::op -> (calls, bytes, simulated time in us)
        "bytes_moved",  # simulated device-memory traffic of launched kernels
        "device_time_us",  # simulated device time of launched kernels
        # queue side
        "errors_deferred",  # kernel failures recorded on the queue
        "errors_raised",  # NeuronRuntimeErrors raised at sync points
        "kernels_skipped",  # kernels not run because an input was poisoned
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ops_recorded = 0
        self._python_views = 0
        self._native_views_at_reset = _native_views()
        self.kernels_launched = 0
        self.fallback_ops = Counter()
        self.sync_points = Counter()
        self.launches_by_stream = {}
        self.collectives = Counter()
        self.collective_totals = {}
        self.bytes_moved = 0
        self.device_time_us = 0.0
        self.errors_deferred = 0
        self.errors_raised = 0
        self.kernels_skipped = 0

    @property
    def view_ops(self) -> int:
        """Metadata-only ops (views, ``t_``, ``resize_``...): run on the host, no launch;
        those of the C++ view kernels included."""
        return self._python_views + _native_views() - self._native_views_at_reset

    def count_view(self) -> None:
        """One metadata-only op run in Python."""
        self._python_views += 1


COUNTERS = DeviceCounters()
