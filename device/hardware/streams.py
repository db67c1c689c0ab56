"""Streams and events, all on the one hardware execution queue.

Entry points: :class:`Stream`, :class:`Event`, :func:`current_stream`,
:func:`default_stream`, :func:`set_stream`, :func:`stream` (context manager); exported as
``torch.neuron.*`` and reachable through ``torch.accelerator``.

TorchNeuron states this limit frankly, and so do we: every stream maps onto a single
hardware queue. Order is always kept (work on stream B issued after work on stream A runs
after it, with or without ``wait_stream``), and no stream gets an engine of its own, so
streams never overlap. What a stream still gives: a name for work in the statistics
(launches per stream) and the trace, ``query``/``synchronize`` of its own last item, and
events.

Events carry *simulated* device time: ``elapsed_time`` is the simulated milliseconds the
queue spent between the two events (kernel costs from the cost model), not host time.

The current stream is process-wide, not per thread: the autograd engine's thread then
launches backward kernels on the stream the forward ran on, as on CUDA. A stream belongs
to a device index (``Stream(device="neuron:1")``, the current device by default) and each
index has its default stream (id 0); all of them feed the one queue.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from ..core.counters import COUNTERS
from ..core.reasons import Flush
from ..memory.indices import current_index, exchange_index, index_of
from . import sink
from .execution_queue import HOST_LOCK, QUEUE

_DEVICE_TYPE = torch._C._autograd.DeviceType.PrivateUse1
_ids = itertools.count(1)


class StreamState:
    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = 0  # id of the current stream (0: the default stream)


STATE = StreamState()


class Stream(torch.Stream):
    """A neuron stream. All streams share the one hardware queue (see module docstring)."""

    def __new__(cls, device=None, priority: int = 0, *, _stream_id=None, **kwargs):
        index = index_of(device)
        stream_id = next(_ids) if _stream_id is None else _stream_id
        self = super().__new__(cls, stream_id=stream_id, device_index=index, device_type=int(_DEVICE_TYPE))
        self._priority = priority
        return self

    def __init__(self, *args, **kwargs) -> None:
        pass

    @property
    def priority(self) -> int:
        return self._priority

    def query(self) -> bool:
        """True when everything issued on this stream has run."""
        sink.flush(Flush.STREAM_QUERY)
        last = QUEUE.last_on_stream.get(self.stream_id, 0)
        if last > QUEUE.completed:
            QUEUE.ring()
        return QUEUE.completed >= last

    def synchronize(self) -> None:
        """Wait for this stream's work (a sync point; rethrows deferred errors)."""
        sink.synchronize(Flush.STREAM_SYNCHRONIZE)

    def wait_stream(self, stream) -> None:
        # One in-order queue: the other stream's work already runs before ours.
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __eq__(self, other) -> bool:
        return (isinstance(other, torch.Stream) and other.stream_id == self.stream_id
                and other.device_type == self.device_type and other.device_index == self.device_index)

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device_index, "neuron"))

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id}>"


_DEFAULTS = {0: Stream(0, _stream_id=0)}  # index -> that device's default stream (id 0)
_streams_by_id = {}  # id -> a stream made current (not a default one)


def default_stream(device=None) -> Stream:
    """The default stream of ``device`` (the current device by default)."""
    index = index_of(device)
    stream = _DEFAULTS.get(index)
    if stream is None:
        stream = _DEFAULTS[index] = Stream(index, _stream_id=0)
    return stream


def current_stream(device=None) -> Stream:
    """The current stream: process-wide (module docstring); when it is a default stream,
    ``device``'s default stream."""
    if STATE.current == 0:
        return default_stream(device)
    return _streams_by_id[STATE.current]


def set_stream(stream: Stream) -> None:
    """Make ``stream`` current, and its device the current device (as
    ``torch.cuda.set_stream``). A stream change is a fusion boundary (it flushes the
    adaptive window), so no fused kernel spans two streams."""
    if stream is None:
        return
    if stream.device_index != current_index():
        exchange_index(stream.device_index)
    stream_id = stream.stream_id
    if stream_id == STATE.current:
        return
    sink.flush(Flush.STREAM_CHANGE)
    if stream_id and stream_id not in _streams_by_id:
        _streams_by_id[stream_id] = stream if isinstance(stream, Stream) else Stream(
            stream.device_index, _stream_id=stream_id)
    STATE.current = stream_id


@contextlib.contextmanager
def stream(stream):
    """``with torch.neuron.stream(s):`` runs the block with ``s`` current."""
    if stream is None:
        yield
        return
    previous = current_stream()
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)


class Event:
    """A neuron event. Its timestamp is the simulated device clock when the queue reaches
    it, which is known at record time: one in-order queue never reorders work."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._sequence: int | None = None  # the queue's items through the recorded point
        self._clock_us: float | None = None
        self._device_index: int | None = None  # the recording stream's device

    @property
    def device(self) -> torch.device | None:
        """The device of the stream that recorded it (None before it is recorded), as CUDA's."""
        return None if self._device_index is None else torch.device("neuron", self._device_index)

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        with HOST_LOCK:
            sink.flush(Flush.EVENT_RECORD)
            self._device_index = stream.device_index
            self._clock_us = QUEUE.clock_us
            self._sequence = QUEUE.submitted

    def query(self) -> bool:
        if self._sequence is None:
            return True
        QUEUE.ring()
        return QUEUE.is_complete(self._sequence)

    def wait(self, stream: Stream | None = None) -> None:
        # Work issued after this on any stream already runs after the recorded point.
        pass

    def synchronize(self) -> None:
        """Wait until the queue reaches this event (a sync point; rethrows errors)."""
        if self._sequence is None:
            return
        COUNTERS.sync_points[Flush.EVENT_SYNCHRONIZE] += 1
        QUEUE.ring()
        QUEUE.wait_for(self._sequence)
        QUEUE.raise_pending()

    def elapsed_time(self, end_event: "Event") -> float:
        """Simulated device milliseconds between this event and ``end_event``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._clock_us is None or end_event._clock_us is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end_event._clock_us - self._clock_us) / 1000.0

    def __repr__(self) -> str:
        state = "unrecorded" if self._sequence is None else ("complete" if self.query() else "pending")
        return f"<torch.neuron.Event {state}>"
