"""Where recorded ops go (the sink), and sync points.

Entry points: :func:`synchronize` (a sync point), :func:`drain` (wait for the device
without raising), :func:`flush` (launch what the sink holds), :func:`set_sink` (the adaptive runtime plugs its op window in here). The
dispatcher hands each recorded op to ``current_sink().record``.

The sink sits between op interception and the execution queue. The strict-eager sink
launches every record at once. The adaptive runtime installs a sink that buffers records
in a window and launches fused kernels when it flushes. A sync point first flushes the
sink, then waits for the queue and rethrows the earliest deferred error.
"""
from __future__ import annotations

from ..core.config import CONFIG
from ..core.counters import COUNTERS
from ..core.reasons import Flush
from .execution_queue import HOST_LOCK, QUEUE
from .op_record import native_launch


class StrictSink:
    """Strict eager: one recorded op is one kernel launch, submitted at once."""

    name = "strict"

    def record(self, record) -> None:
        cost = record.cost
        # run in C++ by the worker; a Python item while tracing or profiling
        item = record if QUEUE.trace_recorder is not None or not CONFIG.native else native_launch(record)
        QUEUE.launch(item, record.op, cost.bytes, cost.time_us, record.stream)
        if CONFIG.launch_blocking:
            QUEUE.wait()

    def flush(self, reason: str) -> None:
        pass


STRICT_SINK = StrictSink()
_sink = STRICT_SINK


def current_sink():
    return _sink


def set_sink(sink) -> None:
    """Install ``sink`` (an object with ``record(op_record)`` and ``flush(reason)``).
    The previous sink is flushed first, so no recorded op is lost."""
    global _sink
    with HOST_LOCK:
        if sink is _sink:
            return
        _sink.flush(Flush.MODE_CHANGE)
        _sink = sink


def flush(reason: str) -> None:
    with HOST_LOCK:
        _sink.flush(reason)


def drain(reason: str) -> None:
    """Launch everything recorded and wait for the device, raising nothing: a deferred
    error stays pending for the next sync point."""
    with HOST_LOCK:
        _sink.flush(reason)
        COUNTERS.sync_points[reason] += 1
    QUEUE.drain()


def synchronize(reason: str = Flush.SYNCHRONIZE) -> None:
    """A sync point: launch everything recorded, wait for the device, raise deferred errors."""
    with HOST_LOCK:
        _sink.flush(reason)
        COUNTERS.sync_points[reason] += 1
    QUEUE.wait()
