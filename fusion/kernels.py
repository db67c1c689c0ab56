"""Fused kernels: what a group of ops costs, and how it runs as one launch.

Entry points: :func:`group_spec` (a planned group, with its window's ``WindowGraph``,
-> :class:`GroupSpec`), :class:`KernelSpec` (the cacheable, position-free description of
a fused kernel), :class:`KernelCache` (an LRU of specs by signature),
:class:`FusedKernel` (one launch on the execution queue) and :class:`WindowLaunches` (a
flushed window's launches, handed to the queue as one command list).

A fused kernel runs its ops back to back on the device worker, in program order, keeping
its *dead intermediates* in an environment instead of device memory: an output produced
and consumed inside the kernel, with no live Python reference and no view at flush, is
never written back. Its cost counts only what crosses the kernel's boundary: each outside
tensor read once, each surviving output written once.

When an op inside fails, the rest of the kernel is replayed op by op with strict eager's
rules (ops reading a poisoned buffer are skipped), the deferred error names the exact op
and the user's line, and the kernel's signature is reported to the runtime, which marks
it unfusable.
"""
from __future__ import annotations

import logging
import threading

import torch

from adaptive_eager_device.cost_model import PROFILE
from adaptive_eager_device.op_record import in_layout, resolve, run_record

from . import compiled as compiled_kernels
from .caches import CountingLRU
from .matching import checks_pass

LOG = logging.getLogger("adaptive_eager.fusion")

# signatures of fused kernels that failed; the runtime drains it (worker -> host)
FAILED_SIGNATURES: list = []
_failed_lock = threading.Lock()


def short_name(record) -> str:
    name = record.name
    return name[6:] if name.startswith("aten::") else name


class KernelSpec:
    """A fused kernel, independent of where its ops sit in a window."""

    __slots__ = ("signature", "name", "dead", "dead_at", "last_uses", "bytes", "time_us", "bytes_saved", "ops",
                 "patterns", "launches", "compiled")

    def __init__(self, signature, name, dead, nbytes, time_us, bytes_saved, ops, patterns=(), last_uses=()) -> None:
        self.signature = signature
        self.name = name  # "mul|add|relu"
        self.dead = dead  # frozenset of (member offset, result position) kept in registers
        # per member offset: the result positions of that op kept in registers (or None)
        self.dead_at = tuple(frozenset(p for o, p in dead if o == offset) or None for offset in range(ops))
        # per member offset: the dead values (producer offset, result position) it reads
        # last, released from the kernel's registers once it has run
        self.last_uses = last_uses
        # the built kernel (fusion.compiled), made on the worker once the kernel is hot:
        # None until then, False when it cannot be built
        self.launches = 0
        self.compiled = None
        self.bytes = nbytes
        self.time_us = time_us
        self.bytes_saved = bytes_saved
        self.ops = ops
        # patterns.PatternSpec: chains inside the kernel that run as one library kernel each
        self.patterns = patterns


class GroupSpec:
    """A planned group: window positions, plus its kernel when it fuses several ops."""

    __slots__ = ("members", "kernel")

    def __init__(self, members: tuple, kernel: KernelSpec | None) -> None:
        self.members = members
        self.kernel = kernel  # None: a single op, launched as in strict eager


class KernelCache(CountingLRU):
    """Built kernels by signature (LRU), with hit/miss/eviction counters."""

    def __init__(self, maxsize: int = 4096) -> None:
        super().__init__(maxsize)

    def get_or_build(self, signature, build):
        spec = self.lookup(signature)
        if spec is None:
            spec = self[signature] = build()
        return spec

    def invalidate(self, signature) -> None:
        self.pop(signature, None)

    def stats(self) -> dict:
        """The LRU's counters, plus how many cached kernels are built (``fusion.compiled``)
        and how many stay op by op."""
        specs = list(self._data.values())
        return dict(
            super().stats(),
            built=sum(1 for spec in specs if spec.compiled),
            op_by_op=sum(1 for spec in specs if spec.compiled is False),
        )


def _signature(members, graph, where, dead) -> tuple:
    """What identifies a fused kernel: its ops' signatures, how data flows between them,
    which of their outputs are dead, and which outside storages are the same one (numbered
    by first appearance, complemented), since a built kernel's in-place rules depend on it.
    ``where``: window position -> offset in ``members``."""
    records = graph.records
    producer = graph.producer
    outside: dict = {}

    def number(storage):
        produced = producer.get(storage)
        if produced is not None:
            offset = where.get(produced[0])  # produced inside the kernel, by this member
            if offset is not None:
                return offset
        found = outside.get(storage)
        if found is None:
            found = outside[storage] = ~len(outside)
        return found

    flow = tuple(
        (tuple(number(storage) for storage in records[index].reads),
         tuple(number(storage) for storage in records[index].writes))
        for index in members
    )
    return (tuple(records[index].key for index in members), flow, tuple(sorted(dead)), len(members))


def _build_spec(members, graph, where, dead, signature, patterns=(), repeats=1, dead_writes=frozenset()) -> KernelSpec:
    records = graph.records
    producer = graph.producer
    dead_storages = {records[members[offset]].results[position] for offset, position in dead}
    external_reads: dict = {}
    written: dict = {}
    compute_us = 0.0
    unfused_bytes = 0
    for offset, index in enumerate(members):
        record = records[index]
        cost = record.cost
        unfused_bytes += cost.bytes
        compute_us += cost.compute_us
        for storage, nbytes in zip(record.reads, cost.read_bytes):
            produced = producer.get(storage)
            if produced is None or produced[0] not in where:  # from outside the kernel
                external_reads[storage] = max(external_reads.get(storage, 0), nbytes)
        for position, (storage, nbytes) in enumerate(zip(record.results, cost.result_bytes)):
            if storage is not None and (offset, position) not in dead:
                written[storage] = max(written.get(storage, 0), nbytes)
        for storage, nbytes in zip(record.writes, cost.write_bytes):
            if storage not in dead_storages and storage not in dead_writes:
                written[storage] = max(written.get(storage, 0), nbytes)
    # what a library kernel does not move whole (a flash kernel writes and reads row
    # statistics in place of its scores) counts the bytes it moves instead: a result
    # (position >= 0) it writes, or an input it reads (position ~argument index)
    for pattern in patterns:
        for offset, position, charged in pattern.charges:
            record = records[members[offset]]
            if position >= 0:
                storage = record.results[position]
                if storage in written:
                    written[storage] = charged
            else:
                ref = record.args[~position]
                storage = getattr(ref, "storage", ref)
                if storage in external_reads:
                    external_reads[storage] = charged
    # a library kernel reads its chain's inputs where it runs: at the chain's last op
    runs_at = {offset: pattern.root for pattern in patterns for offset in pattern.members}
    last_read: dict = {}
    for offset, index in enumerate(members):
        for storage in records[index].reads:
            if storage in dead_storages:  # produced inside: a dead output is touched only here
                position, result = producer[storage]
                value = (where[position], result)
                last_read[value] = max(last_read.get(value, 0), runs_at.get(offset, offset))
    last_uses = [[] for _ in members]
    for value, offset in last_read.items():
        last_uses[offset].append(value)
    nbytes = sum(external_reads.values()) + sum(written.values())
    memory_us = nbytes / PROFILE.hbm_bandwidth_bytes_per_s * 1e6
    time_us = PROFILE.launch_overhead_us + max(memory_us, compute_us)
    name = _kernel_name(members[: len(members) // repeats], records, patterns)
    if repeats > 1:
        name = f"{name} x{repeats}"
    return KernelSpec(
        signature, name, frozenset(dead), nbytes, time_us, max(unfused_bytes - nbytes, 0), len(members), patterns,
        tuple(tuple(values) for values in last_uses),
    )


def _kernel_name(members, records, patterns) -> str:
    """``mul|add|relu``; a library kernel's chain shows as ``rms_norm(pow|mean|...)``,
    where the chain starts."""
    chain_of = {pattern.members[0]: pattern for pattern in patterns}
    inside = {offset for pattern in patterns for offset in pattern.members}
    parts = []
    for offset, index in enumerate(members):
        pattern = chain_of.get(offset)
        if pattern is not None:
            parts.append(f"{pattern.name}({'|'.join(short_name(records[members[o]]) for o in pattern.members)})")
        elif offset not in inside:
            parts.append(short_name(records[index]))
    return "|".join(parts)


def group_spec(members, graph, kernel_cache=None, matches=(), repeats=1) -> GroupSpec:
    """A planned group of window positions -> its ``GroupSpec``, the window's facts read
    from its ``WindowGraph``. Its kernel (several ops, or a library kernel) comes from
    ``kernel_cache`` by signature, built on a miss."""
    members = tuple(members)
    if len(members) == 1 and not matches:
        return GroupSpec(members, None)
    records = graph.records
    touched_by = graph.touched_by
    escaping = graph.escaping
    inside = set(members)
    # outputs every user of which is inside the kernel, not referenced at flush: kept in
    # registers, never written back
    dead = {
        (offset, position)
        for offset, index in enumerate(members)
        for position, storage in enumerate(records[index].results)
        if storage is not None and (index, position) not in escaping and touched_by[storage] <= inside
    }
    # Writes in place to a storage nothing references any more (``graph.released``),
    # touched only inside the kernel: nothing can read the value after it, so it is never
    # written back either.
    released = graph.released
    dead_writes = {
        (offset, i)
        for offset, index in enumerate(members)
        for i, storage in enumerate(records[index].writes)
        if storage in released and touched_by[storage] <= inside
    }
    where = {index: offset for offset, index in enumerate(members)}
    signature = _signature(members, graph, where, dead) + (tuple(sorted(dead_writes)),) + tuple(
        (match.name, tuple(where[p] for p in match.members)) for match in sorted(matches, key=lambda m: m.members)
    )

    def build():
        patterns = tuple(match.spec(members) for match in sorted(matches, key=lambda m: m.members))
        written_dead = {records[members[offset]].writes[i] for offset, i in dead_writes}
        return _build_spec(members, graph, where, dead, signature, patterns, repeats, written_dead)

    spec = kernel_cache.get_or_build(signature, build) if kernel_cache is not None else build()
    return GroupSpec(members, spec)


class WindowLaunches:
    """A flushed window's launches, in plan order, as one queue item: the host hands the
    device a command list (accounted kernel by kernel, ``ExecutionQueue.launch_batch``),
    and the device worker builds the fused kernels and runs them in order. ``launches`` is
    ``Plan.launches``: ``(position, None)`` for an op alone, ``(positions, KernelSpec)``."""

    __slots__ = ("launches", "records", "stream")

    def __init__(self, launches, records, stream: int) -> None:
        self.launches = launches
        self.records = records
        self.stream = stream

    def kernels(self) -> list:
        records = self.records
        return [
            records[members] if spec is None else FusedKernel([records[index] for index in members], spec, self.stream)
            for members, spec in self.launches
        ]

    def execute(self, queue) -> None:
        # Release each kernel's records once it has run, as strict eager drops each op:
        # a buffer no later kernel reads is freed now, and its memory is reused by the
        # next allocation instead of the window's footprint growing to its sum.
        records = self.records
        stream = self.stream
        for members, spec in self.launches:
            if spec is None:
                kernel = records[members]
                records[members] = None
            else:
                kernel = FusedKernel([records[index] for index in members], spec, stream)
                for index in members:
                    records[index] = None
            kernel.execute(queue)
            kernel = None


class FusedKernel:
    """One launch that runs several recorded ops (see module docstring)."""

    __slots__ = ("records", "spec", "stream")

    def __init__(self, records, spec: KernelSpec, stream: int) -> None:
        self.records = records
        self.spec = spec
        self.stream = stream

    @property
    def name(self) -> str:
        return self.spec.name

    def execute(self, queue) -> None:
        spec = self.spec
        if queue.faults is not None or queue.failures.first is not None or (queue.poison_seen and self._reads_poison()):
            self._run_ops(queue, library=False)  # the per-op failure rules: faults, drops, poison
            return
        compiled = spec.compiled
        if compiled is None and compiled_kernels.ENABLED:
            spec.launches += 1
            if spec.launches >= compiled_kernels.HOT_AFTER:
                self._build_and_run(queue)
                return
        elif compiled and self._run_compiled(compiled):
            return
        self._run_ops(queue)

    def _run_ops(self, queue, library: bool = True) -> bool:
        """Run the ops in program order, dead intermediates in ``env``; each matched chain
        as its library kernel at its last op (``library``), unless a constant it depends
        on differs in this launch. True if an op failed."""
        env: dict = {}
        spec = self.spec
        last_uses = spec.last_uses
        dead_at = spec.dead_at
        records = self.records
        at_root: dict = {}
        skipped: set = set()
        if library:
            for pattern in spec.patterns:
                if not pattern.checks or checks_pass(pattern.checks, records):
                    at_root[pattern.root] = pattern
                    skipped.update(pattern.members[:-1])
        failed = False
        name = spec.name
        for offset, record in enumerate(records):
            if offset in skipped:
                pass
            elif offset in at_root:
                pattern = at_root[offset]
                if not self._run_library(pattern, env):
                    # the library kernel raised: its ops, one by one, name the failing one
                    for member in pattern.members:
                        failed = run_record(records[member], queue, env, dead_at[member], name) or failed
            else:
                failed = run_record(record, queue, env, dead_at[offset], name) or failed
            for producer, position in last_uses[offset]:  # free registers no later op reads
                env.pop(records[producer].results[position], None)
        if failed:
            with _failed_lock:
                FAILED_SIGNATURES.append(spec.signature)
        return failed

    def _run_library(self, pattern, env: dict) -> bool:
        """A matched chain's library kernel; False (run its ops instead) if it raises."""
        records = self.records
        dead = self.spec.dead
        try:
            inputs = [resolve(records[offset].args[index], env) for offset, index in pattern.inputs]
            result = pattern.impl(*inputs, **pattern.constants)
            values = (result,) if isinstance(result, torch.Tensor) else tuple(result)
            for (offset, position), value in zip(pattern.outputs, values):
                storage = records[offset].results[position]
                if (offset, position) in dead:
                    env[storage] = in_layout(storage, value)
                else:
                    storage.adopt(value)
        except Exception:  # noqa: BLE001
            return False
        return True

    def _run_compiled(self, compiled) -> bool:
        """The built kernel: one call. False (run op by op instead, which names the op
        that fails) when it raises; it writes nothing in place, so replaying is safe."""
        records = self.records
        for pattern in self.spec.patterns:  # its library kernels' constants, as matched?
            if pattern.checks and not checks_pass(pattern.checks, records):
                return False
        try:
            values = compiled.run(records)
            for (offset, position), value in zip(compiled.outputs, values):
                records[offset].results[position].adopt(value)
        except Exception:  # noqa: BLE001
            return False
        return True

    def _build_and_run(self, queue) -> None:
        """Build the hot kernel, run it beside the op-by-op run of this same launch, and
        keep it only if its outputs are bit-identical (``fusion.compiled``)."""
        spec = self.spec
        if any(pattern.checks and not checks_pass(pattern.checks, self.records) for pattern in spec.patterns):
            self._run_ops(queue)  # its library kernels' constants differ this time: build later
            return
        compiled = compiled_kernels.build(self.records, spec)
        values = None
        if compiled is not None:
            try:
                values = compiled.run(self.records)  # no side effects: nothing in place
            except Exception as error:  # noqa: BLE001
                LOG.debug("built kernel %s raised (%s): it stays op by op", spec.name, error)
        failed = self._run_ops(queue)
        if values is not None and not failed and compiled_kernels.same_outputs(values, self.records, compiled.outputs):
            spec.compiled = compiled
        else:
            if values is not None and not failed:
                LOG.debug("built kernel %s differs from its ops: it stays op by op", spec.name)
            spec.compiled = False

    def _reads_poison(self) -> bool:
        return any(storage.poison is not None for record in self.records for storage in record.reads)
