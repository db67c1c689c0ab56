"""The op window of adaptive eager: buffer recorded ops, flush them as fused kernels.

Entry points: :class:`AdaptiveSink` (installed by ``adaptive_eager.enable()`` between op
interception and the execution queue) and :class:`WindowPolicy` (its thresholds).

Ops on ``neuron`` are recorded into the window, not launched. The window is flushed:

- at a sync point (host reads, ``synchronize``, data-dependent shapes, CPU fallbacks);
- when it holds ``NEURON_ADAPTIVE_WINDOW`` ops ("window_full");
- before a barrier op, which then runs alone ("barrier: <op>");
- on a stream change, an event record or a mode change;
- by the adaptive policy ("queue_shallow"), under our policy (``NEURON_ADAPTIVE_POLICY=ours``,
  the default; TorchNeuron's own is the other row of ``adaptive_eager/policies.py``, whose
  fields this window reads: regions closed after a matmul, broken by in-place ops and
  copies, buffered only while more than 15 kernels wait): once the window holds
  ``NEURON_ADAPTIVE_MIN_WINDOW`` ops, it is flushed as soon as the device's simulated
  backlog falls to ``NEURON_ADAPTIVE_SHALLOW_US`` or below (the device is about to starve:
  feed it now). While the device is busy (deep queue), the window keeps buffering, so
  longer chains fuse. It never flushes between two foreach ops: a multi-tensor chain (an
  optimizer step) stays in one window, so the foreach loop rule makes it one kernel. The
  backlog is simulated (``ExecutionQueue.backlog_us``), so windows,
  plans and statistics are the same on every run.

At a flush the window's structure (op signatures, data flow, aliasing, which outputs are
still referenced) keys the *plan cache*; on a miss, ``fusion.plan_window`` plans it. Each
group becomes one launch: a fused kernel, or the op itself when it fuses with nothing. The
window goes to the queue as one command list (``adaptive_eager_device.hardware.fused_kernel``),
which the device worker runs.

The window reads the queue only through its public API (``device/hardware/execution_queue.py``):
``backlog_us()`` for the policy, ``injecting_faults`` and ``observing`` at a flush, and
``take_failed_kernels()``: the fused kernels an op failed in, whose chains it stops
fusing.
"""
from __future__ import annotations

import logging

import torch
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.core.reasons import Flush
from adaptive_eager_device.hardware.execution_queue import QUEUE
from adaptive_eager_device.hardware.fused_kernel import WindowLaunches
from adaptive_eager_device.hardware.plan import library_kernels_off
from adaptive_eager_device.hardware.profiler import PROFILER

from .fusion.caches import CountingLRU
from .fusion.categories import BARRIER, FOREACH, category
from .fusion.kernels import KernelCache
from .fusion.planner import plan_window
from .policies import POLICIES, AdaptivePolicy, breaks_region
from .statistics import FUSION

LOG = logging.getLogger("adaptive_eager.window")


def _configured(attribute: str) -> property:
    """A policy field that is the configuration's value ``CONFIG.<attribute>``, read and
    written live."""
    return property(lambda self: getattr(CONFIG, attribute), lambda self, value: setattr(CONFIG, attribute, value))


class WindowPolicy:
    """Adaptive eager's window thresholds (documented in the module docstring and the
    README), read live from ``CONFIG`` (``NEURON_ADAPTIVE_*``): ``max_ops`` and
    ``min_ops`` (window size bounds), ``shallow_us`` (the starved device's backlog),
    ``patterns`` (the pattern library), ``on_chip_bytes`` (the on-chip rule's budget:
    one NeuronCore's SBUF; 0 turns the rule off) and ``policy`` (``ours`` or
    ``torchneuron``: the row of ``policies.POLICIES`` whose rules apply, :attr:`rules`).
    ``adaptive_eager.window_policy`` changes them for a region."""

    FIELDS = {"max_ops": "window_ops", "min_ops": "min_window_ops", "shallow_us": "shallow_us",
              "patterns": "patterns", "on_chip_bytes": "on_chip_bytes", "policy": "adaptive_policy"}

    max_ops = _configured("window_ops")
    min_ops = _configured("min_window_ops")
    shallow_us = _configured("shallow_us")
    patterns = _configured("patterns")
    on_chip_bytes = _configured("on_chip_bytes")
    policy = _configured("adaptive_policy")

    @property
    def rules(self) -> AdaptivePolicy:
        """The policy's row of ``policies.POLICIES``."""
        return POLICIES[self.policy]

    def limits(self) -> tuple:
        """``(rules, max_ops, min_ops, shallow_us)`` in one call (the window reads them per
        op; each property is a Python call). A policy that sets any of them otherwise
        overrides this too (``compiler._WholeGraph``)."""
        config = CONFIG
        return POLICIES[config.adaptive_policy], config.window_ops, config.min_window_ops, config.shallow_us


def structure_key(ops, referenced=None) -> tuple:
    """A window's plan-cache key, flat: ``(parts, later)``.

    ``ops``: per op, ``(signature number, storages read, written, produced)`` (a produced
    storage None where an op makes no tensor). Per op, the key holds its signature's number
    (negated), then the local number of each storage it reads, writes and produces (data
    flow and aliasing; numbers in order of first appearance). The signature fixes how
    many of each there are, so nothing separates the three lists. An *escaping* output's
    number is complemented (negative): one still needed after the flush, because its
    storage is still referenced (by the user, a view, autograd's saved tensors, an
    optimizer's state: ``DeviceStorage.alive``). So is a written storage's when nothing
    references it any more (its write need not be written back).

    ``referenced(storage)`` says whether a storage is still referenced (default: its
    ``alive``); None where only a later call can say (a compiled graph's template, whose
    inputs' liveness is its call's): those written entries are listed in ``later`` as
    ``(position in parts, storage)``, holding the not-complemented number.
    Built in one pass at every flush: this is host time per op."""
    local: dict = {}
    parts = []
    later = []
    append = parts.append
    get = local.get
    for signature_id, reads, writes, results in ops:
        append(-signature_id)
        for storage in reads:
            number = get(storage)
            if number is None:
                number = local[storage] = len(local)
            append(number)
        for storage in writes:
            number = get(storage)
            if number is None:
                number = local[storage] = len(local)
            kept = storage.alive if referenced is None else referenced(storage)
            if kept is None:
                later.append((len(parts), storage))
            append(~number if kept is False else number)  # dead writes are not written back
        for storage in results:
            if storage is None:
                append(None)
            else:
                local[storage] = number = len(local)
                append(~number if (storage.alive if referenced is None else referenced(storage)) else number)
    return parts, later


class AdaptiveSink:
    """The op window. ``name`` is "adaptive" for adaptive eager's one window; a compiled
    graph's window (``compiler.GraphRunner``) is "compiled", with caches of its own."""

    def __init__(self, policy: WindowPolicy | None = None, name: str = "adaptive", shared_caches: bool = True) -> None:
        self.name = name
        self.policy = policy or WindowPolicy()
        self.records: list = []
        self.plan_cache = CountingLRU(maxsize=1024)  # plans by window structure
        self.kernel_cache = KernelCache()
        self.unfusable: set = set()
        # id(op) -> its fusion category: an int key hashes in C, an OpOverload in Python
        self.kind_by_op: dict = {}
        self.closed = False  # the last op recorded closed its region (a policy's closes_after)
        self.planned_with = None  # the policy the cached plans were made under
        if shared_caches:
            FUSION.caches["plan_cache"] = self.plan_cache
            FUSION.caches["kernel_cache"] = self.kernel_cache

    # -- recording ---------------------------------------------------------------------
    def record(self, record) -> None:
        op = record.op
        kind = self.kind_by_op.get(id(op))
        if kind is None:
            kind = self.kind_by_op[id(op)] = category(op)
        rules, max_ops, min_ops, shallow_us = self.policy.limits()
        if kind is BARRIER:
            self.flush(Flush.BARRIER.of(record.name))
            self._launch_single(record)
            return
        if rules.breaks:  # (TorchNeuron's) in-place ops and copies run alone
            broken = breaks_region(op, kind)
            if broken:
                self.flush(Flush.REGION_BREAK.of(f"{broken}: {record.name}"))
                self._launch_single(record)
                return
        # The policy flushes *before* appending: the op being recorded has not yet handed
        # its outputs to the caller, so it must not be judged dead in a flush now.
        if self.closed:  # the op before closed its region (a matmul, under TorchNeuron's rules)
            self.flush(Flush.REGION_CLOSED)
        if rules.off_when_deterministic and torch.are_deterministic_algorithms_enabled():
            self.flush(Flush.DETERMINISTIC)
            self._launch_single(record)
            return
        records = self.records
        count = len(records)
        if count >= (rules.max_ops or max_ops):
            self.flush(Flush.WINDOW_FULL)
            records = self.records
        elif rules.low_water_kernels is not None:
            if QUEUE.backlog_kernels() <= rules.low_water_kernels:  # not buffering: launch now
                self.flush(Flush.QUEUE_SHALLOW)
                self._launch_single(record)
                return
        elif count >= min_ops and QUEUE.device_free_us - QUEUE.host_us <= shallow_us and not (  # backlog_us()
            kind is FOREACH and self.kind_by_op.get(id(records[-1].op)) is FOREACH
        ):  # (a multi-tensor chain, an optimizer step, stays in one window: one kernel)
            self.flush(Flush.QUEUE_SHALLOW)  # the device is starved
            records = self.records
        records.append(record)
        if kind in rules.closes_after:
            self.closed = True
        if CONFIG.launch_blocking:
            self.flush(Flush.LAUNCH_BLOCKING)
            QUEUE.wait()

    # -- flushing ----------------------------------------------------------------------
    def flush(self, reason: str, key: tuple | None = None) -> None:
        """Plan (or look up) the window's records and hand them to the queue. ``key``: the
        window's ``_structure``, when the caller knows it already (a compiled graph's
        replay, ``replay.Template.structure``)."""
        self.closed = False
        records = self.records
        if not records:
            return
        self.records = []
        FUSION.flushes[reason] += 1
        failed = QUEUE.take_failed_kernels()
        if failed:
            self._mark_unfusable(failed)
        if key is None:
            key = self._structure(records)
        policy = self.policy
        rules = policy.rules
        if rules is not self.planned_with:  # plans depend on the policy: a switch starts afresh
            if self.planned_with is not None:
                self.plan_cache.clear()
            self.planned_with = rules
        injecting = QUEUE.injecting_faults  # any op may fail: plan afresh, in program order
        plan = None if injecting else self.plan_cache.lookup(key)
        if plan is None:
            escaping, released = self._escape_bits(records, key)
            plan = plan_window(
                records, lambda index, position: (index, position) in escaping, self.unfusable,
                self.kernel_cache, policy.on_chip_bytes, policy.patterns if rules.patterns is None else rules.patterns,
                every_op_fallible=injecting, released=released, whole_window=rules.whole_window,
            )
            if not injecting:
                self.plan_cache[key] = plan
            for reason_text, count in plan.refusals.items():
                FUSION.refusals[reason_text] += count
        self._hand_over(plan, records)

    @staticmethod
    def _structure(records) -> tuple:
        """The window's plan-cache key (:func:`structure_key` of its records)."""
        parts, _ = structure_key([(r.signature_id, r.reads, r.writes, r.results) for r in records])
        return tuple(parts)

    @staticmethod
    def _escape_bits(records, key) -> tuple:
        """What a ``_structure`` key marks: the (record, output position) of the escaping
        outputs, and the written storages nothing references any more. The plan is made
        from these, not from ``DeviceStorage.alive`` again, so it always matches its key."""
        escaping = set()
        released = set()
        at = 0
        for index, record in enumerate(records):
            at += 1 + len(record.reads)  # the id, reads
            for storage in record.writes:
                if key[at] < 0:
                    released.add(storage)
                at += 1
            for position in range(len(record.results)):
                number = key[at]
                if number is not None and number < 0:
                    escaping.add((index, position))
                at += 1
        return escaping, released

    def _hand_over(self, plan, records) -> None:
        """Hand the window to the queue. The records belong to the device worker from
        then on (it releases each kernel's records as it runs them), so everything the
        host needs from them is read first."""
        stream = records[0].stream  # one window, one stream (a stream change flushes)
        off = library_kernels_off(plan, records) if plan.library else frozenset()
        self._count(plan, off)
        command_list = WindowLaunches(plan.launches, records, stream, off, plan.programs)
        if not QUEUE.observing:  # in C++ on the worker, or this command list where it cannot
            QUEUE.launch_batch(CONFIG.native and command_list.native() or command_list, plan.costs, stream)
        else:  # the trace and the profiler see every kernel on its own
            QUEUE.launch_batch(command_list.kernels(), plan.costs, stream)

    @staticmethod
    def _count(plan, off) -> None:
        """The fusion counters of one window handed over under ``plan``."""
        totals = plan.totals
        if totals[0]:
            FUSION.fused_kernels += totals[0]
            FUSION.ops_fused += totals[1]
            FUSION.bytes_saved += totals[2]
            FUSION.dead_intermediates += totals[3]
            for name, kernels, ops in plan.matched_patterns(off):  # one whose constants differ runs the ops
                FUSION.pattern(name, ops, kernels)

    def hand_over_program(self, reason: str, plan_for, launch_for) -> bool:
        """A window whose records were never made (a compiled graph's replayed call): its
        plan looked up by ``plan_for(plan_cache)`` as ``flush`` looks it up (its plan-cache
        key, ``replay.Template.plan_for``), and ``launch_for(plan)`` ->
        ``(native launch, library kernels off, stream)`` or None handed to the queue with
        the same accounting. False (nothing done) when the plan is not cached yet, faults are
        injected, the timeline or a torch profile is recorded or the native path is off:
        then the caller makes the records and flushes them."""
        if QUEUE.observing or QUEUE.injecting_faults or not CONFIG.native or PROFILER._is_profiler_enabled:
            return False  # (the profiler ties the records' ops to the compiled call)
        failed = QUEUE.take_failed_kernels()
        if failed:
            self._mark_unfusable(failed)
        plan = plan_for(self.plan_cache)
        if plan is None:
            return False
        made = launch_for(plan)
        if made is None:
            return False
        launch, off, stream = made
        FUSION.flushes[reason] += 1
        self._count(plan, off)
        QUEUE.launch_batch(launch, plan.costs, stream)
        return True

    @staticmethod
    def _launch_single(record) -> None:
        cost = record.cost
        QUEUE.launch(record, record.op, cost.bytes, cost.time_us, record.stream)

    def _mark_unfusable(self, signatures) -> None:
        """Fused kernels an op failed in (``QUEUE.take_failed_kernels``): their op chains
        are not fused again; plans holding them are dropped."""
        for signature in signatures:
            self.unfusable.add(signature[0])
            self.kernel_cache.invalidate(signature)
            FUSION.replays += 1
        self.plan_cache.clear()
        LOG.debug("fused kernels failed; their op chains are now unfusable")
