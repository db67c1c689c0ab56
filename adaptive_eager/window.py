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
from weakref import ref

from .device.config import CONFIG, env_flag, env_float
from .device.cost_model import PROFILE
from .device.queue import QUEUE
from .fusion.caches import CountingLRU
from .fusion.categories import BARRIER, category
from .fusion.kernels import FAILED_SIGNATURES, FusedKernel, KernelCache
from .fusion.planner import plan_window
from .statistics import FUSION

LOG = logging.getLogger("adaptive_eager.window")


class WindowPolicy:
    """The window's thresholds (documented in the module docstring and the README)."""

    def __init__(self) -> None:
        self.max_ops = int(env_float("NEURON_ADAPTIVE_WINDOW", 128))
        self.min_ops = int(env_float("NEURON_ADAPTIVE_MIN_WINDOW", 16))
        self.shallow_us = env_float("NEURON_ADAPTIVE_SHALLOW_US", 20.0)
        self.dead_intermediates = env_flag("NEURON_ADAPTIVE_ELIMINATE_DEAD", True)
        self.patterns = env_flag("NEURON_ADAPTIVE_PATTERNS", True)  # the pattern library
        self.horizontal = env_flag("NEURON_ADAPTIVE_HORIZONTAL", True)  # multi-tensor kernels
        # the on-chip rule's budget: one NeuronCore's SBUF (0 turns the rule off)
        self.on_chip_bytes = int(env_float("NEURON_ADAPTIVE_ON_CHIP_MB", PROFILE.sbuf_bytes / (1 << 20)) * (1 << 20))


class AdaptiveSink:
    name = "adaptive"

    def __init__(self, policy: WindowPolicy | None = None) -> None:
        self.policy = policy or WindowPolicy()
        self.records: list = []
        self.outputs: list = []  # per record: weak references to its output tensors
        self.plan_cache = CountingLRU(maxsize=1024)  # plans by window structure
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
        for storage in record.results:
            if storage is not None:
                storage.views = []  # track views of it until the flush
        self.records.append(record)
        # Weak references: holding the outputs would change PyTorch's behaviour (autograd
        # steals a gradient buffer only when nothing else references it).
        if len(outputs) == 1:
            self.outputs.append((ref(outputs[0]),) if outputs[0] is not None else (None,))
        else:
            self.outputs.append([None if tensor is None else ref(tensor) for tensor in outputs])
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
        escaping = self._escaping(records, outputs)
        key = self._window_key(records, escaping)
        plan = self.plan_cache.lookup(key)
        if plan is None:
            plan = plan_window(
                records, lambda index, position: (index, position) in escaping, self.unfusable,
                self.kernel_cache, self.policy.on_chip_bytes, self.policy.patterns, self.policy.horizontal,
            )
            self.plan_cache[key] = plan
            for reason_text, count in plan.refusals.items():
                FUSION.refusals[reason_text] += count
        self._launch(plan, records)

    def _escaping(self, records, outputs) -> set:
        """(record, output position) of every output still needed after the flush: one
        still referenced (by the user, autograd's saved tensors, a container), viewed by a
        live view, or pinned."""
        escaping = set()
        keep_all = not self.policy.dead_intermediates
        for index, record in enumerate(records):
            tensors = outputs[index]
            position = 0
            for storage in record.results:
                if storage is not None:
                    live_view = storage.has_live_view()
                    storage.views = None  # decided: stop tracking its views
                    if keep_all or storage.pinned or live_view:
                        escaping.add((index, position))
                    else:
                        weak = tensors[position] if position < len(tensors) else None
                        if weak is None or weak() is not None:
                            escaping.add((index, position))
                position += 1
        return escaping

    @staticmethod
    def _window_key(records, escaping) -> tuple:
        """The window's structure, flat: per op, its signature's number (negated), then
        the local number of each storage it reads, writes and produces (data flow and
        aliasing; numbers in order of first appearance), an escaping output's number
        complemented. Separators keep the encoding unambiguous."""
        local: dict = {}
        parts = []
        append = parts.append
        get = local.get
        index = 0
        for record in records:
            append(-record.key_id)
            for storage in record.reads:
                number = get(storage)
                if number is None:
                    number = local[storage] = len(local)
                append(number)
            writes = record.writes
            if writes:
                append("w")
                for storage in writes:
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
                    append(~number if (index, position) in escaping else number)
                position += 1
            index += 1
        return tuple(parts)

    def _launch(self, plan, records) -> None:
        launch = QUEUE.launch
        for members, spec in plan.launches:
            if spec is None:
                record = records[members]
                cost = record.cost
                launch(record, record.op, cost.bytes, cost.time_us, record.stream)
            else:
                group = [records[index] for index in members]
                stream = group[0].stream
                launch(FusedKernel(group, spec, stream), spec.name, spec.bytes, spec.time_us, stream, spec.ops)
        totals = plan.totals
        if totals[0]:
            FUSION.fused_kernels += totals[0]
            FUSION.ops_fused += totals[1]
            FUSION.bytes_saved += totals[2]
            FUSION.dead_intermediates += totals[3]
            for name, ops in totals[4]:
                FUSION.pattern(name, ops)

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
