"""The timeline: a Chrome trace of host op issue and device kernel execution.

Entry points: :func:`start`, :func:`stop` (returns the trace dict, and writes it when
given a path), and ``NEURON_TRACE=<path.json>`` (traces the whole process and writes the
file at exit). Open the file in ui.perfetto.dev or chrome://tracing.

Three tracks ("processes" in the trace-event format):

- **host**: one slice per op as the host issued it (real time), per thread;
- **neuron:0 worker (real time)**: when the worker actually ran each kernel, one row
  per stream;
- **neuron:0 (simulated time)**: each kernel at its simulated start and duration on the
  single hardware queue, one row per stream. The simulated timeline includes idle time:
  a kernel starts once the simulated host has issued it (``NEURON_SIM_HOST_US`` per op)
  and the kernel before it has ended, so a starved device shows gaps.

Flow arrows (correlation ids) link every issued op to the kernel that ran it: a fused
kernel receives arrows from all its ops.

``torch.profiler`` shows the device too, for tools that read its traces: kernels on a
device lane, flows from their ops, device time in ``key_averages()``
(``device/hardware/profiler.py``, ``device/csrc/profiler.cpp``).
"""
from __future__ import annotations

import atexit
import itertools
import json
import threading
import time

from ..core.config import CONFIG
from ..core.location import source_location
from ..core.reasons import Flush

HOST_PID, WORKER_PID, SIMULATED_PID = 1, 2, 3


def _thread_name() -> str:
    """The issuing thread's name for the timeline. A thread Python did not start (a
    ``threading._DummyThread``, "Dummy-1") that issues ops inside ``backward()`` is
    PyTorch's autograd engine thread for the device: "autograd"."""
    current = threading.current_thread()
    if isinstance(current, threading._DummyThread):
        from torch._C import _current_graph_task_id

        return "autograd" if _current_graph_task_id() != -1 else f"native thread ({current.name})"
    return current.name


class TraceRecorder:
    def __init__(self, clock_origin_us: float = 0.0) -> None:
        self.origin = time.perf_counter()
        self.clock_origin_us = clock_origin_us  # the simulated timeline when tracing began
        self.events: list = []
        self._ids = itertools.count(1)
        self.kernels: dict = {}  # queue sequence -> (name, stream, op ids)
        self._threads: dict = {}

    def _us(self, seconds: float) -> float:
        return round((seconds - self.origin) * 1e6, 3)

    # -- host side ---------------------------------------------------------------------
    def issue(self, record, started: float) -> None:
        """The host issued ``record`` (an OpRecord), between ``started`` and now."""
        op_id = next(self._ids)
        record.trace_id = op_id
        now = time.perf_counter()
        thread = threading.get_ident()
        if thread not in self._threads:
            self._threads[thread] = _thread_name()
        self.events.append(
            {
                "name": record.name,
                "ph": "X",
                "pid": HOST_PID,
                "tid": thread,
                "ts": self._us(started),
                "dur": max(round((now - started) * 1e6, 3), 0.001),
                "args": {"op_id": op_id, "stream": record.stream, "issued_at": str(source_location(record.location))},
            }
        )
        self.events.append({"name": "issue", "cat": "issue", "ph": "s", "id": op_id, "pid": HOST_PID, "tid": thread, "ts": self._us(started)})

    def kernel(self, item, name, simulated_start_us: float, simulated_us: float, stream: int, sequence: int) -> None:
        """A kernel was launched (host side): its simulated slot on the queue."""
        op_ids = tuple(getattr(record, "trace_id", 0) for record in getattr(item, "records", (item,)))
        name = name if isinstance(name, str) else name._schema.name
        self.kernels[sequence] = (name, stream, op_ids)
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "pid": SIMULATED_PID,
                "tid": stream,
                "ts": round(simulated_start_us - self.clock_origin_us, 3),
                "dur": round(simulated_us, 3),
                "args": {"sequence": sequence, "ops": len(op_ids)},
            }
        )

    # -- device side -------------------------------------------------------------------
    def executed(self, sequence: int, started: float, finished: float) -> None:
        kernel = self.kernels.pop(sequence, None)
        if kernel is None:  # a fence or an event marker
            return
        name, stream, op_ids = kernel
        ts = self._us(started)
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "pid": WORKER_PID,
                "tid": stream,
                "ts": ts,
                "dur": max(round((finished - started) * 1e6, 3), 0.001),
                "args": {"sequence": sequence, "ops": len(op_ids)},
            }
        )
        for op_id in op_ids:
            if op_id:
                self.events.append({"name": "issue", "cat": "issue", "ph": "f", "bp": "e", "id": op_id, "pid": WORKER_PID, "tid": stream, "ts": ts})

    def to_dict(self) -> dict:
        metadata = [
            {"name": "process_name", "ph": "M", "pid": HOST_PID, "args": {"name": "host"}},
            {"name": "process_name", "ph": "M", "pid": WORKER_PID, "args": {"name": "neuron:0 worker (real time)"}},
            {"name": "process_name", "ph": "M", "pid": SIMULATED_PID, "args": {"name": "neuron:0 (simulated time)"}},
        ]
        for thread, name in self._threads.items():
            metadata.append({"name": "thread_name", "ph": "M", "pid": HOST_PID, "tid": thread, "args": {"name": name}})
        streams = {e["tid"] for e in self.events if e.get("pid") in (WORKER_PID, SIMULATED_PID) and e["ph"] == "X"}
        for stream in sorted(streams):
            for pid in (WORKER_PID, SIMULATED_PID):
                metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": stream, "args": {"name": f"stream {stream}"}})
        return {"traceEvents": metadata + list(self.events), "displayTimeUnit": "ms"}


def start() -> TraceRecorder:
    """Start recording the timeline (replacing any recording in progress)."""
    from .execution_queue import QUEUE

    QUEUE.drain()
    recorder = TraceRecorder(max(QUEUE.host_us, QUEUE.device_free_us))
    QUEUE.set_trace_recorder(recorder)
    return recorder


def stop(path: str | None = None) -> dict:
    """Stop recording; return the trace, and write it to ``path`` if given."""
    from .execution_queue import QUEUE
    from .sink import flush

    flush(Flush.TRACE)
    QUEUE.drain()
    recorder = QUEUE.set_trace_recorder(None)
    trace = recorder.to_dict() if recorder is not None else {"traceEvents": []}
    if path:
        with open(path, "w") as handle:
            json.dump(trace, handle)
    return trace


def _write_at_exit() -> None:
    from .execution_queue import QUEUE

    if QUEUE.trace_recorder is not None and CONFIG.trace_path:
        stop(CONFIG.trace_path)


def start_from_environment() -> None:
    if CONFIG.trace_path:
        start()
        atexit.register(_write_at_exit)
