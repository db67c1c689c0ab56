"""Fused kernels as the planner describes them: what a group of ops is, and what it costs.

Entry points: :func:`group_spec` (a planned group, with its window's ``WindowGraph``,
-> ``GroupSpec``) and :class:`KernelCache` (an LRU of ``KernelSpec`` by signature).

``GroupSpec`` and ``KernelSpec`` are the plan format's (``device/hardware/plan.py``):
immutable once built; the device executes them and keeps what its launches change
(launch counts) in a table of its own, never on the spec.

A fused kernel runs its ops back to back, in program order, keeping its *dead
intermediates* in registers instead of device memory: an output produced and consumed
inside the kernel, with no live Python reference and no view at flush, is never written
back. Its cost counts only what crosses the kernel's boundary: each outside tensor read
once, each surviving output written once. Its time is the busiest of its engines (each
the sum of its ops' time on that engine) and of its DMA traffic (those bytes), without the
launch overhead, which the queue adds per launch (``device/hardware/cost_model.py``).
"""
from __future__ import annotations

from adaptive_eager_device.hardware.cost_model import ENGINES, PROFILE
from adaptive_eager_device.hardware.plan import GroupSpec, KernelSpec

from .caches import CountingLRU


def short_name(record) -> str:
    name = record.name
    return name[6:] if name.startswith("aten::") else name


class KernelCache(CountingLRU):
    """Kernel specs by signature (LRU), with hit/miss/eviction counters."""

    def __init__(self, maxsize: int = 4096) -> None:
        super().__init__(maxsize)

    def get_or_build(self, signature, build):
        spec = self.lookup(signature)
        if spec is None:
            spec = self[signature] = build()
        return spec

    def invalidate(self, signature) -> None:
        self.pop(signature, None)



def _signature(members, graph, where, dead) -> tuple:
    """What identifies a fused kernel: its ops' signatures, how data flows between them,
    which of their outputs are dead, and which outside storages are the same one (numbered
    by first appearance, complemented), since a native program's in-place rules depend on it.
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
    return (tuple(records[index].signature for index in members), flow, tuple(sorted(dead)), len(members))


def _build_spec(members, graph, where, dead, signature, patterns=(), repeats=1, dead_writes=frozenset()) -> KernelSpec:
    records = graph.records
    producer = graph.producer
    dead_storages = {records[members[offset]].results[position] for offset, position in dead}
    external_reads: dict = {}
    written: dict = {}
    engine_us = [0.0] * len(ENGINES)
    unfused_bytes = 0
    for offset, index in enumerate(members):
        record = records[index]
        cost = record.cost
        unfused_bytes += cost.bytes
        for engine, us in enumerate(cost.engine_us):
            engine_us[engine] += us
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
    # its ops run back to back on each engine, the engines and the DMA queues in parallel;
    # the launch overhead is the queue's to add, per launch (cost_model.py)
    time_us = PROFILE.kernel_time_us(nbytes, engine_us)
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
