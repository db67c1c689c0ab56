"""The op window of adaptive eager: buffer recorded ops, flush them as fused kernels.

Entry points: :class:`AdaptiveSink` (installed by ``adaptive_eager.enable()`` between op
interception and the execution queue) and :class:`WindowPolicy` (its thresholds).

Ops on ``neuron`` are recorded into the window, not launched. The window is flushed:

- at a sync point (host reads, ``synchronize``, data-dependent shapes, CPU fallbacks);
- when it holds ``NEURON_ADAPTIVE_WINDOW`` ops ("window_full");
- before a barrier op, which then runs alone ("barrier: <op>");
- on a stream change, an event record or a mode change;
- by the adaptive policy ("queue_shallow"): once the window holds
  ``NEURON_ADAPTIVE_MIN_WINDOW`` ops, it is flushed as soon as the device's simulated
  backlog falls to ``NEURON_ADAPTIVE_SHALLOW_US`` or below (the device is about to starve:
  feed it now). While the device is busy (deep queue), the window keeps buffering, so
  longer chains fuse. The backlog is simulated (``ExecutionQueue.backlog_us``), so windows,
  plans and statistics are the same on every run.

At a flush the window's structure (op signatures, data flow, aliasing, which outputs are
still referenced) keys the *plan cache*; on a miss, ``fusion.plan_window`` plans it. Each
group becomes one launch: a fused kernel, or the op itself when it fuses with nothing.
"""
from __future__ import annotations

import logging
from sys import getrefcount

import cachetools

from .device.config import CONFIG, env_flag, env_float
from .device.cost_model import PROFILE
from .device.queue import QUEUE
from .fusion.categories import BARRIER, category
from .fusion.kernels import FAILED_SIGNATURES, FusedKernel, KernelCache
from .fusion.planner import plan_window
from .stats import FUSION

LOG = logging.getLogger("adaptive_eager.window")


class WindowPolicy:
    """The window's thresholds (documented in the module docstring and the README)."""

    def __init__(self) -> None:
        self.max_ops = int(env_float("NEURON_ADAPTIVE_WINDOW", 128))
        self.min_ops = int(env_float("NEURON_ADAPTIVE_MIN_WINDOW", 8))
        self.shallow_us = env_float("NEURON_ADAPTIVE_SHALLOW_US", 20.0)
        self.dead_intermediates = env_flag("NEURON_ADAPTIVE_ELIMINATE_DEAD", True)
        # the on-chip rule's budget: one NeuronCore's SBUF (0 turns the rule off)
        self.on_chip_bytes = int(env_float("NEURON_ADAPTIVE_ON_CHIP_MB", PROFILE.sbuf_bytes / (1 << 20)) * (1 << 20))


class PlanCache:
    """Plans by window structure (LRU), with hit/miss/eviction counters."""

    def __init__(self, maxsize: int = 1024) -> None:
        self.evictions = 0
        outer = self

        class _LRU(cachetools.LRUCache):
            def popitem(self):
                outer.evictions += 1
                return super().popitem()

        self._cache = _LRU(maxsize=maxsize)
        self.hits = 0
        self.misses = 0

    def get(self, key):
        plan = self._cache.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def put(self, key, plan) -> None:
        self._cache[key] = plan

    def clear(self) -> None:
        self._cache.clear()

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "size": len(self._cache)}

    def reset_counters(self) -> None:
        self.hits = self.misses = self.evictions = 0


class AdaptiveSink:
    name = "adaptive"

    def __init__(self, policy: WindowPolicy | None = None) -> None:
        self.policy = policy or WindowPolicy()
        self.records: list = []
        self.outputs: list = []  # per record: its output tensors, held until the flush
        self.plan_cache = PlanCache()
        self.kernel_cache = KernelCache()
        self.unfusable: set = set()
        FUSION.caches["plan_cache"] = self.plan_cache
        FUSION.caches["kernel_cache"] = self.kernel_cache

    # -- recording ---------------------------------------------------------------------
    def record(self, record, outputs=()) -> None:
        if category(record.op) is BARRIER:
            self.flush(f"barrier: {record.name}")
            self._launch_single(record)
            return
        # The policy flushes *before* appending: the op being recorded has not yet handed
        # its outputs to the caller, so it must not be judged dead in a flush now.
        count = len(self.records)
        if count >= self.policy.max_ops:
            self.flush("window_full")
        elif count >= self.policy.min_ops and QUEUE.backlog_us() <= self.policy.shallow_us:
            self.flush("queue_shallow")
        self.records.append(record)
        self.outputs.append(outputs)
        if CONFIG.launch_blocking:
            self.flush("launch_blocking")
            QUEUE.wait()

    # -- flushing ----------------------------------------------------------------------
    def flush(self, reason: str) -> None:
        records = self.records
        if not records:
            return
        outputs = self.outputs
        self.records, self.outputs = [], []
        FUSION.flushes[reason] += 1
        if FAILED_SIGNATURES:
            self._mark_failed_unfusable()

        def escapes(index: int, position: int) -> bool:
            storage = records[index].results[position]
            if storage is None:
                return False
            if storage.pinned or not self.policy.dead_intermediates or storage.has_live_view():
                return True
            tensors = outputs[index]
            if position >= len(tensors):
                return True
            # Referenced from anywhere but this window (the user, autograd's saved tensors,
            # a container)? The window's list, this local and getrefcount's argument make 3.
            tensor = tensors[position]
            return tensor is not None and getrefcount(tensor) > 3

        key = self._window_key(records, escapes)
        plan = self.plan_cache.get(key)
        if plan is None:
            plan = plan_window(records, escapes, self.unfusable, self.kernel_cache, self.policy.on_chip_bytes)
            self.plan_cache.put(key, plan)
            for reason_text, count in plan.refusals.items():
                FUSION.refusals[reason_text] += count
        self._launch(plan, records)

    @staticmethod
    def _window_key(records, escapes) -> tuple:
        """The window's structure, flat: per op, its signature's number, then the local
        number of each storage it reads, writes and produces (data flow and aliasing), and
        whether each output escapes. Separators keep the encoding unambiguous."""
        local: dict = {}
        parts = []
        append = parts.append
        get = local.get
        for index, record in enumerate(records):
            append(-record.key_id)
            for storage in record.reads:
                number = get(storage)
                if number is None:
                    number = local[storage] = len(local)
                append(number)
            append("w")
            for storage in record.writes:
                number = get(storage)
                if number is None:
                    number = local[storage] = len(local)
                append(number)
            append("r")
            position = 0
            for storage in record.results:
                if storage is None:
                    append(None)
                else:
                    local[storage] = number = len(local)
                    append(number if not escapes(index, position) else ~number)
                position += 1
        return tuple(parts)

    def _launch(self, plan, records) -> None:
        launch = QUEUE.launch
        for group in plan.groups:
            spec = group.kernel
            if spec is None:
                self._launch_single(records[group.members[0]])
                continue
            members = [records[index] for index in group.members]
            stream = members[0].stream
            launch(FusedKernel(members, spec, stream), spec.name, spec.bytes, spec.time_us, stream)
            FUSION.fused_kernels += 1
            FUSION.ops_fused += spec.ops
            FUSION.bytes_saved += spec.bytes_saved
            FUSION.dead_intermediates += len(spec.dead)

    @staticmethod
    def _launch_single(record) -> None:
        cost = record.cost
        QUEUE.launch(record, record.op, cost.bytes, cost.time_us, record.stream)

    def _mark_failed_unfusable(self) -> None:
        while FAILED_SIGNATURES:
            signature = FAILED_SIGNATURES.pop()
            self.unfusable.add(signature[0])
            self.kernel_cache.invalidate(signature)
            FUSION.replays += 1
        self.plan_cache.clear()
        LOG.debug("fused kernels failed; their op chains are now unfusable")
