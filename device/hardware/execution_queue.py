"""The single hardware execution queue, drained in order by one device worker thread.

Entry points: :data:`QUEUE` (the device's queue) and :class:`ExecutionQueue`.

Every stream maps onto this one FIFO, as on TorchNeuron: order is always kept, and no
stream gets an engine of its own. An item on the queue is anything with an
``execute(queue)`` method: an ``OpRecord`` (one strict-eager kernel), a fused kernel or
a window's command list (``device/hardware/fused_kernel.py``), a fence (what ``synchronize``
waits on) or an event marker; or a native launch (``device/csrc/executor.cpp``: one op, a
window's launches or a compiled call's program), which the worker runs in C++ and hands
back to Python (``_run_fallback``) when the failure rules apply.

The host accounts for a kernel when it launches it (``launch``: launches, bytes, the
simulated clock). Items call back into the queue to report failures
(``device/hardware/op_record.py: run_record`` applies the rules):

- ``fail(failure, written)``: a kernel raised; keep the earliest failure (in issue order)
  for the next sync point and poison what the kernel left without valid data;
- ``drop(results)``: a kernel issued after a pending failure does not run; its fresh
  outputs are poisoned;
- ``report_failed_kernel(signature)``: a fused kernel had an op fail; the runtime takes
  the signatures at its next flush (``take_failed_kernels``) and stops fusing that chain.

What the host side (the runtime, ``adaptive_eager``) asks of the queue is public API, not
its fields: ``launch``, ``launch_batch``, ``backlog_us()`` (the simulated device ahead of
the host), ``backlog_kernels()`` (launched kernels not yet finished, simulated),
``trace_recorder`` (the timeline while tracing, else None; set by ``set_trace_recorder``),
``observing`` (tracing: each kernel its own Python queue item),
``native_counts()``, ``injecting_faults``,
``issue_ops`` (ops issued without the per-op path: a compiled graph's replay),
``take_failed_kernels`` and ``reset_kernel_summary``. A fused kernel asks
``must_run_op_by_op(records)`` before it runs, and ``op_record.run_record`` applies the
failure rules to each op.

The host waits with :meth:`ExecutionQueue.wait`, which rethrows the earliest failure as
``NeuronRuntimeError`` and clears it, so the device is usable again afterwards.

``torch.profiler``: every launch accounted here (``launch``, ``launch_batch``, ``account``:
what ``stats()["kernels_launched"]`` counts) is also told to the device's Kineto profiler
(``device/hardware/profiler.py``) while a profile records, and each wait is a
``neuron::synchronize`` range; with no profiler, one module-global read per launch.

:data:`HOST_LOCK`: the host side of the device is one critical section. Ops issued from
several threads are recorded, windowed and submitted one at a time, in one issue order,
as one CUDA stream orders work from several threads. Every op holds it while the
dispatcher handles it, and so do flushes and submissions; waiting for the device does
not (the worker never takes it).
"""
from __future__ import annotations

import collections
import os
import threading
import time

import torch

from .. import _C as _native
from ..core.config import CONFIG, parse_fault_spec
from ..core.counters import COUNTERS
from ..core.errors import FailureState, KernelFailure, NeuronRuntimeError
from ..memory.storage import ReinterpretRef, ViewRef, keep_freed_memory
from . import profiler
from .profiler import PROFILER

_native.executor_types(ViewRef, ReinterpretRef)  # the references a native program resolves

HOST_LOCK = threading.RLock()
# The longest a host thread waiting for the worker, or the worker waiting for work, polls
# before it sleeps, when a core is free for it (ExecutionQueue.follow_threads). An
# assumption sized to the waits it should catch: a `generate` token's sync waits 0.1-2 ms for
# its graph here, and the host prepares the next token for about 1 ms (bench/realtime.py);
# past it, the thread sleeps and pays the wake-up.
SPIN_US = 2000


class FaultInjector:
    """Make the n-th kernel running a given op fail, for tests (``NEURON_SIM_FAULT``)."""

    def __init__(self, faults=()) -> None:
        """``faults``: (op name, n) pairs, or their ``NEURON_SIM_FAULT`` spelling."""
        self.targets: dict[str, set[int]] = {}
        self.seen: dict[str, int] = {}
        for name, nth in parse_fault_spec(faults) if isinstance(faults, str) else faults:
            self.add(name, nth)

    def add(self, op_name: str, nth: int) -> None:
        if "::" not in op_name:
            op_name = "aten::" + op_name
        self.targets.setdefault(op_name, set()).add(nth)

    def check(self, op_name: str) -> None:
        targets = self.targets.get(op_name)
        if targets is None:
            return
        count = self.seen[op_name] = self.seen.get(op_name, 0) + 1
        if count in targets:
            raise RuntimeError(f"injected fault: {op_name} kernel #{count} failed (NEURON_SIM_FAULT)")


class ExecutionQueue:
    def __init__(self) -> None:
        # The worker (device/csrc/executor.cpp): the FIFO and the thread that drains it,
        # started at the first ring.
        self._worker = _native.Worker()
        self._started = False
        self._start_lock = threading.Lock()
        self.issued = 0  # ops recorded so far: each record's place in issue order (host side)
        self.submitted = 0  # items put on the queue (host side)
        # the earliest failure not yet raised; the worker knows whether one is pending
        self.failures = FailureState(lambda pending: self._worker.flags(failure_pending=pending))
        self._poison_seen = False
        self._faults = None
        self.faults: FaultInjector | None = FaultInjector(CONFIG.faults) if CONFIG.faults else None
        # The simulated timeline (deterministic: costs only, never host timing):
        self.clock_us = 0.0  # device busy time: the sum of launched kernels' times
        self.host_us = 0.0  # host clock: CONFIG.host_us_per_op per issued op; waits at sync points
        self.device_free_us = 0.0  # when the device finishes the last launched kernel
        self.kernel_totals: dict = {}  # kernel name or op -> [launches, simulated us, bytes]
        # simulated ends of the launched kernels the simulated host has not yet seen finish,
        # in order (one in-order queue): backlog_kernels()
        self._ends: collections.deque = collections.deque()
        self.trace_recorder = None  # a device.trace.TraceRecorder while tracing (read-only: set_trace_recorder)
        self._failed_kernels: list = []  # signatures of fused kernels an op failed in (worker -> host)
        self._failed_lock = threading.Lock()
        self.last_on_stream: dict[int, int] = {}  # stream id -> sequence of its last item
        # Doorbell batching: submitted items wait in ``_batch`` until the host rings.
        self._batch: list = []
        self._batch_bytes = 0
        self._batch_ops = 0
        # 64 ops: a batch's records (each op's launch holds about eight Python containers
        # and its output storages until the host releases it after it ran, ``ring``) stay
        # under the garbage collector's first threshold (700 allocations), so a long run of
        # small ops without a sync neither triggers collections nor ages records into the
        # old generation, and the worker runs a batch while the host records the next
        # (measured against 1,024 and others: docs/PERFORMANCE.md, "Host overhead per op").
        self.batch_items = 64
        self.batch_bytes = 1 << 20
        # How long a host thread waiting for the worker, and the worker waiting for work,
        # poll before they sleep (follow_threads sets both).
        self.spin_us = 0

    # -- host side -------------------------------------------------------------------
    def submit(self, item, stream_id: int = 0, nbytes: int = 0, ops: int = 1) -> int:
        """Put ``item`` on the queue. Items reach the worker in batches (see ``ring``): the
        batch rings when it holds ``batch_items`` launches or ``batch_bytes`` of traffic.
        In C (``_C.submit``, ``device/csrc/record.cpp``), which the C recorder calls too."""
        return _native.submit(self, item, stream_id, nbytes, ops)

    def ring(self) -> None:
        """Hand the batched items to the device worker (the doorbell).

        The host rings when a batch is full (``batch_items`` launches, or ``batch_bytes`` of
        memory traffic: enough work to overlap with the host)
        and at every sync point. Ringing per item would wake the worker on every op, and
        make the two threads trade the GIL on every op that runs as a Python item (a native
        launch runs without it); ringing rarely keeps the records of many ops alive (their
        Python objects are released here, once they ran: see ``batch_items``).
        """
        with HOST_LOCK:
            batch = self._batch
            if batch:
                if not self._started:
                    self._start()
                self._batch = []
                self._batch_bytes = 0
                self._batch_ops = 0
                self._worker.push(batch)
            self._worker.release()  # the Python objects of the native launches that ran

    def launch(self, kernel, key, nbytes: int, time_us: float, stream: int, ops: int = 1) -> int:
        """Submit one kernel launch and account for it (``time_us``: its time without the
        launch overhead, which ``_account`` adds)."""
        start = self._account(1, nbytes, time_us, None, stream, key=key)
        if PROFILER._is_profiler_enabled:
            profiler.launched(kernel, key, time_us + CONFIG.launch_us, stream)
        sequence = self.submit(kernel, stream, nbytes, ops)
        if self.trace_recorder is not None:
            self.trace_recorder.kernel(kernel, key, start, time_us + CONFIG.launch_us, stream, sequence)
        return sequence

    def launch_batch(self, kernels, costs, stream: int) -> None:
        """Submit kernels issued together (one flush of an adaptive window; ``costs``: the
        plan's ``LaunchCosts``, theirs in order) and account for them in bulk: the same
        counters and timeline as ``launch`` per kernel, at a fraction of the host time.
        Issued at one simulated instant, they run back to back from
        ``max(device free, host)``.

        ``kernels`` is a list of queue items, one per kernel, or one item (a command
        list) that runs them all; the trace needs the list, to give each its own slot."""
        if self.trace_recorder is not None:
            for kernel, (key, nbytes, time_us, ops) in zip(kernels, costs.each):
                self.launch(kernel, key, nbytes, time_us, stream, ops)
            return
        count = len(costs.each)
        self._account(count, costs.nbytes, costs.time_us, costs.by_key, stream, costs.each)
        if PROFILER._is_profiler_enabled:
            profiler.launched_window(kernels, costs, stream, CONFIG.launch_us)  # before the worker can release the records
        if type(kernels) is list:
            self.submitted += count
            self._batch.extend(kernels)
        else:
            self.submitted += 1
            self._batch.append(kernels)
        self.last_on_stream[stream] = self.submitted
        self._batch_bytes += costs.nbytes
        self._batch_ops += costs.ops
        if self._batch_ops >= self.batch_items or self._batch_bytes >= self.batch_bytes:
            self.ring()

    def account(self, key, nbytes: int, time_us: float, stream: int) -> float:
        """Count one launch the host runs itself, inside its op (a data-dependent op, a
        collective; ``key``: its op; ``time_us``: its time without the launch overhead) and
        return its simulated start on the timeline."""
        start = self._account(1, nbytes, time_us, None, stream, key=key)
        if PROFILER._is_profiler_enabled:
            profiler.host_kernel(key, time_us + CONFIG.launch_us, stream)
        return start

    def _account(self, count: int, nbytes: int, time_us: float, by_key, stream: int, each=None, key=None) -> float:
        """Count ``count`` launches issued together (``by_key``: ``(key, launches, time_us,
        bytes)`` per op or kernel name) and return the first one's simulated start. The
        simulated clocks advance here, at submission: with one in-order queue, a kernel
        starts when both the one before it has ended and the simulated host has issued
        it, so its slot is known when it is issued.

        ``time_us`` are the kernels' costs without the launch overhead (the cost model's,
        cached per op signature and per fused kernel); each launch adds
        ``CONFIG.launch_us`` (``NEURON_SIM_LAUNCH_US``) here, read live. ``each``: the
        launches' ``(key, bytes, time_us, ops)`` in order, when there are several (their
        ends, for :meth:`backlog_kernels`). One launch passes ``key`` and no ``by_key`` (the
        per-op path: no tuple made for it). In C (``_C.account``, ``device/csrc/record.cpp``,
        with Python's own arithmetic on these attributes), which the C recorder calls too."""
        return _native.account(self, COUNTERS, count, nbytes, time_us, by_key, stream, each, key, CONFIG.launch_us)

    def depth(self) -> int:
        """Items submitted and not yet run by the worker thread (real, timing-dependent)."""
        return self.submitted - self.completed

    def backlog_us(self) -> float:
        """Simulated work queued ahead of the host: how long the device stays busy if the
        host launches nothing more. At or below zero, the device is starved.

        The simulated host issues one op every ``CONFIG.host_us_per_op`` (``NEURON_SIM_HOST_US``,
        default 5 us: an *assumption*, about a CUDA eager framework's per-op host cost) and
        waits for the device at sync points; kernels start when both the host has launched
        them and the device is free. Being deterministic, it makes adaptive windows, plans
        and statistics repeatable run to run.
        """
        return self.device_free_us - self.host_us

    def backlog_kernels(self) -> int:
        """Kernels launched and not yet finished on the simulated timeline at the simulated
        host's time (the running one included): the execution queue's depth in kernels, as
        TorchNeuron's adaptive eager reads it (``adaptive_eager/policies.py``). Deterministic,
        as :meth:`backlog_us`."""
        ends = self._ends
        host = self.host_us
        while ends and ends[0] <= host:
            ends.popleft()
        return len(ends)

    def issue_ops(self, count: int) -> int:
        """Issue ``count`` ops at once, as the host would one by one (a compiled graph's
        replay): returns the issue number before the first, and advances the simulated
        host clock by ``count`` ops."""
        first = self.issued
        self.issued = first + count
        self.host_us += CONFIG.host_us_per_op * count
        return first

    # -- observing -------------------------------------------------------------------
    def set_trace_recorder(self, recorder):
        """Start (a ``TraceRecorder``) or stop (None) recording the timeline; returns the
        recorder it replaces."""
        previous, self.trace_recorder = self.trace_recorder, recorder
        return previous

    @property
    def observing(self) -> bool:
        """Tracing: each kernel goes on the queue as its own Python item (not a native
        launch), so the timeline gives it a slot of its own (the profiler needs none: it
        lays kernels out at launch, from their records)."""
        return self.trace_recorder is not None

    @property
    def injecting_faults(self) -> bool:
        """Is a fault injected (``NEURON_SIM_FAULT``, ``inject_fault``)? Any op may fail."""
        return self.faults is not None

    @property
    def completed(self) -> int:
        """Items the worker finished (device side), in order."""
        return self._worker.completed

    @property
    def poison_seen(self) -> bool:
        """A storage was ever poisoned: kernels check their inputs."""
        return self._poison_seen

    @poison_seen.setter
    def poison_seen(self, value: bool) -> None:
        self._poison_seen = value
        self._worker.flags(poison_seen=value)

    @property
    def faults(self):
        """The fault injector (``NEURON_SIM_FAULT``, ``inject_fault``), or None."""
        return self._faults

    @faults.setter
    def faults(self, injector) -> None:
        self._faults = injector
        self._worker.flags(faults=injector is not None)

    def drain(self) -> None:
        """Wait until everything submitted so far has run. Raises nothing (but
        KeyboardInterrupt)."""
        with HOST_LOCK:
            target = self.submitted
            if self.completed >= target:
                self._worker.release()
                return
            self.ring()
        self.wait_for(target)
        with HOST_LOCK:
            self._worker.release()

    def wait_for(self, sequence: int) -> None:
        """Wait until the worker has run the items through ``sequence`` (rung already):
        in C, without the GIL, woken by the worker without Python (``wait_completed``,
        ``device/csrc/executor.cpp``)."""
        if self._worker.completed < sequence:
            self._worker.wait_completed(sequence, self.spin_us)

    def wait(self) -> None:
        """Drain, then rethrow the earliest deferred failure, if any, and clear it."""
        if PROFILER._is_profiler_enabled:
            begin = profiler.wait_begin()
            self.drain()
            profiler.wait_end(begin)
        else:
            self.drain()
        if self.device_free_us > self.host_us:
            self.host_us = self.device_free_us  # the simulated host waited for the device
        self.raise_pending()

    def raise_pending(self) -> None:
        if self.failures.first is None:
            return
        failure = self.failures.take()
        if failure is not None:
            COUNTERS.errors_raised += 1
            raise NeuronRuntimeError(failure.message(), failure)

    def is_complete(self, sequence: int) -> bool:
        return self.completed >= sequence

    def kernel_summary(self) -> dict:
        """{kernel name: [launches, simulated us, bytes]}, merging overloads of one op."""
        summary: dict = {}
        for key, (launches, time_us, nbytes) in list(self.kernel_totals.items()):
            name = key if isinstance(key, str) else key._schema.name
            entry = summary.setdefault(name, [0, 0.0, 0])
            entry[0] += launches
            entry[1] += time_us
            entry[2] += nbytes
        return summary

    def reset_kernel_summary(self) -> None:
        self.kernel_totals.clear()

    def take_failed_kernels(self) -> list:
        """The signatures of the fused kernels an op failed in since the last call (host
        side: the runtime stops fusing those chains)."""
        if not self._failed_kernels:
            return []
        with self._failed_lock:
            taken, self._failed_kernels = self._failed_kernels, []
        return taken

    # -- device side -----------------------------------------------------------------
    def must_run_op_by_op(self, records) -> bool:
        """Must a fused kernel of ``records`` run each op by the failure rules (a fault
        injected, a failure pending, or a poisoned input), with no library kernel in
        between?"""
        if self.faults is not None or self.failures.first is not None:
            return True
        return self.poison_seen and any(
            storage.poison is not None for record in records for storage in record.reads
        )

    def report_failed_kernel(self, signature) -> None:
        """An op failed inside the fused kernel of ``signature`` (its failure is recorded
        by ``fail``); the runtime takes it at its next flush."""
        with self._failed_lock:
            self._failed_kernels.append(signature)

    def fail(self, failure: KernelFailure, written) -> None:
        self.poison_seen = True
        for storage in written:
            if storage is not None:
                storage.poison = failure
        COUNTERS.errors_deferred += 1
        self.failures.record(failure)

    def drop(self, results) -> None:
        failure = self.failures.first
        for storage in results:
            if storage is not None:
                storage.poison = failure
        COUNTERS.kernels_skipped += 1

    def _start(self) -> None:
        with self._start_lock:
            if not self._started:
                keep_freed_memory()  # the device's memory pool
                self.follow_threads()
                self._worker.start(self._run_item, self._run_fallback)
                self._started = True

    def follow_threads(self) -> None:
        """The worker's kernels use the host's intra-op threads (``torch.get_num_threads()``):
        a CPU kernel's result may depend on how many threads split its work (the fused
        attention kernel's does), and must be the one the host would compute. Called at
        start, and by ``torch.set_num_threads`` after it drained the queue (``backend.py``).

        It also decides whether the two threads poll before they sleep, a host thread
        waiting for the worker (a sync point) and the worker waiting for the next batch:
        only when a core is left over by the worker's threads, as CUDA's default schedule
        spins only while there are fewer active contexts than cores. A sleep costs a
        wake-up on each side and a system call for the thread that wakes it; ``generate``
        syncs every token (measured: docs/PERFORMANCE.md, "Host overhead per op")."""
        threads = torch.get_num_threads()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.spin_us = SPIN_US if threads < cores else 0
        self._worker.flags(threads=threads, spin_us=self.spin_us)

    def _run_item(self, item) -> None:
        """A Python item, on the worker (with the GIL). The worker drops each item (and the
        tensors it holds) before it runs the next one: once a fence signals the host, the
        worker holds no tensor, or a host that exits right away would race the worker's
        deallocations during interpreter finalization."""
        if self.trace_recorder is None:
            item.execute(self)
        else:
            self._launch_observed(item)

    def _run_fallback(self, fallback, resume: int, env: dict) -> None:
        """A native launch the worker handed back (device/csrc/executor.cpp): a failure
        pending, a fault injected, a poisoned input, or a step that raised. Its ops run
        from ``resume`` under the failure rules, with the values it kept in registers."""
        fallback.resume(self, resume, env)

    def native_counts(self) -> dict:
        """``{"native_launches", "fallbacks"}``: launches the worker ran in C++, and those
        it handed to Python."""
        return self._worker.counts()

    def _launch_observed(self, item) -> None:
        """Launch under the timeline: when the worker really ran it."""
        started = time.perf_counter()
        item.execute(self)
        recorder = self.trace_recorder
        if recorder is not None:
            recorder.executed(self.completed + 1, started, time.perf_counter())

    def inject_fault(self, op_name: str, nth: int = 1) -> None:
        """Make the ``nth`` kernel running ``op_name`` fail (counted from now)."""
        if self.faults is None:
            self.faults = FaultInjector()
        self.faults.add(op_name, nth)

    def clear_faults(self) -> None:
        self.faults = None

    def reset_after_fork(self) -> None:
        self.__init__()


QUEUE = ExecutionQueue()

if hasattr(os, "register_at_fork"):
    # A forked child has no worker thread: give it a fresh, empty queue of its own.
    os.register_at_fork(after_in_child=QUEUE.reset_after_fork)
