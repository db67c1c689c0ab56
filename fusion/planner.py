"""Planning one window: which recorded ops run together as one fused kernel.

Entry point: :func:`plan_window` (records, which outputs escape) -> :class:`Plan`. It
builds the window's ``WindowGraph`` (``fusion/window_graph.py``: data flow, escape bits,
hazard edges) once, and the patterns, the merges and the kernel specs all read it.

The contracts, kept apart as in Inductor's scheduler:

- :func:`can_fuse` is legality only: it answers yes, or no with a reason (the loop
  rules below are a table in ``fusion/rules.py``, asked in order);
- :func:`score` is profitability only: the bytes a merge keeps out of device memory;
- :func:`fusion.window_graph.would_create_cycle` guards every merge.

The greedy loop takes data-flow edges best score first and merges the two groups at their
ends when legal. What may share a kernel:

- pointwise (and random) ops over one iteration space, with broadcasting and type
  promotion (their inputs may broadcast; their outputs have one number of elements); a
  pointwise producer whose output its consumer reads broadcast joins the consumer's loop
  (its elements are recomputed there, as Inductor inlines it);
  ``cat`` also has its inputs' iteration spaces: the ops producing its inputs and those
  reading its output fuse with it, and the concatenation, when only the kernel reads
  it, is never written;
- one reduction with its pointwise prologue (ops over its input's elements) and epilogue
  (ops over its input's or its output's elements);
- one matmul-like op with its pointwise epilogue (bias, activation, residual: ops over its
  output's elements). A matmul takes no prologue: it closes the window behind it;
- a library kernel (``fusion/patterns.py``) as the op it stands for: a matmul, a
  reduction or a pointwise op (``patterns.KINDS``), over its outputs' elements;
- multi-tensor (foreach) ops over one tensor group (the same number of elements at each
  position of their lists): an optimizer step over every parameter, as ``_fused_adamw_``,
  with the pointwise ops over one tensor of the group each (the loop over that tensor
  holds them).

Every refusal has a reason, counted in the statistics and logged at DEBUG to
``adaptive_eager.fusion``. Plans are deterministic: ties break by window position.
"""
from __future__ import annotations

import logging
import math

import networkx as nx
import torch
from adaptive_eager_device.core.reasons import Refused
from adaptive_eager_device.hardware.plan import Plan

from .categories import BARRIER, FOREACH, KERNEL, MATMUL, OPAQUE, REDUCTION, category
from .kernels import group_spec
from .patterns import KINDS as LIBRARY_KINDS
from .patterns import find_patterns
from .rules import loop_rules
from .window_graph import WindowGraph, would_create_cycle

LOG = logging.getLogger("adaptive_eager.fusion")
_CAT = torch.ops.aten.cat.default
_ANCHORS = (REDUCTION, MATMUL)


class Group:
    """A set of window positions on its way to becoming one kernel.

    ``footprint`` maps each storage the group touches to its bytes: the working set the
    kernel would keep on chip. ``on_chip_only`` marks a group that only the on-chip rule
    allowed (several anchors, opaque ops, mixed iteration spaces): it may grow further
    only while its working set still fits.
    """

    __slots__ = ("members", "anchor", "anchor_kind", "numels", "footprint", "on_chip_only", "matches", "repeats")

    def __init__(self, index: int, kind: str, record) -> None:
        self.members = [index]
        cost = record.cost
        if kind in _ANCHORS:
            self.anchor, self.anchor_kind = index, kind
            # the iteration spaces a pointwise op may share with this anchor
            self.numels = {cost.numel} if kind == MATMUL else {cost.numel, cost.input_numel}
        elif kind is FOREACH:  # its iteration space: the shape of its tensor group
            self.anchor, self.anchor_kind = None, None
            self.numels = {("foreach", _group_numels(record))}
        else:
            self.anchor, self.anchor_kind = None, None
            self.numels = {cost.numel}
            if record.op is _CAT:  # its inputs' iteration spaces: their producers fuse with it
                self.numels.update(math.prod(getattr(ref, "shape", ())) for ref in record.args[0])
        footprint: dict = {}
        for storages, sizes in ((record.reads, cost.read_bytes), (record.writes, cost.write_bytes), (record.results, cost.result_bytes)):
            for storage, nbytes in zip(storages, sizes):
                if storage is not None and nbytes > footprint.get(storage, 0):
                    footprint[storage] = nbytes
        self.footprint = footprint
        self.on_chip_only = kind in (OPAQUE, KERNEL, BARRIER)
        self.matches = []  # patterns.Match: library kernels inside the group
        self.repeats = 1  # how many same-shaped chains a horizontal fusion put together

    def merged_footprint(self, other: "Group") -> int:
        mine = self.footprint
        total = sum(mine.values())
        for storage, nbytes in other.footprint.items():
            held = mine.get(storage)
            if held is None:
                total += nbytes
            elif nbytes > held:
                total += nbytes - held
        return total

    def absorb(self, other: "Group", on_chip_only: bool) -> None:
        self.members += other.members
        if self.anchor is None and other.anchor is not None:
            self.anchor, self.anchor_kind, self.numels = other.anchor, other.anchor_kind, other.numels
        elif self.anchor is None:  # pointwise groups: one holds the other's iteration spaces
            self.numels = self.numels | other.numels
        for storage, nbytes in other.footprint.items():
            if nbytes > self.footprint.get(storage, 0):
                self.footprint[storage] = nbytes
        self.on_chip_only = self.on_chip_only or other.on_chip_only or on_chip_only
        self.matches += other.matches


def _as_library_kernel(group: Group, match, records) -> None:
    """A matched chain's group, to the loop rules: anchored like the library kernel's kind
    (``patterns.KINDS``), over its outputs' elements (and its inputs', for a reduction)."""
    kind = LIBRARY_KINDS.get(match.name)
    numels = {math.prod(records[p].results[r].shape) for p, r in match.outputs}
    if kind == REDUCTION:
        numels.update(math.prod(getattr(records[p].args[a], "shape", ())) for p, a in match.inputs)
    group.numels = numels
    if kind in _ANCHORS:
        group.anchor, group.anchor_kind = match.members[-1], kind
    else:
        group.anchor, group.anchor_kind = None, None


def _group_numels(record) -> tuple:
    """Elements of each tensor of a foreach op's first list: the group it loops over."""
    first = record.args[0] if record.args else ()
    if not isinstance(first, (list, tuple)):
        return ()
    return tuple(math.prod(getattr(ref, "shape", ())) for ref in first)


def can_fuse(producer: Group, consumer: Group, edge, kinds, records, graph, unfusable,
             members_of=None, on_chip_bytes: int = 0) -> tuple:
    """Legality of merging ``producer`` into ``consumer``, joined by the data-flow ``edge``
    (producer position, consumer position).

    Returns ``(None, on_chip)`` when legal, ``on_chip`` saying that only the on-chip rule
    allowed it; else ``(reason, False)``. The on-chip rule: ops whose combined working set
    fits in ``on_chip_bytes`` (one NeuronCore's SBUF) may share a kernel whatever their
    categories, as in a compiled subgraph; beyond that, the loop rules decide.
    """
    reason = loop_rules(producer, consumer, edge, kinds, records)
    on_chip = False
    if reason is not None:
        if on_chip_bytes and producer.merged_footprint(consumer) <= on_chip_bytes and not any(
            kinds[index] in (BARRIER, KERNEL) for index in producer.members + consumer.members
        ):
            on_chip = True
        else:
            return reason, False
    members = producer.members + consumer.members
    if unfusable and group_key(sorted(members), records) in unfusable:
        return Refused.FAILED_BEFORE, False
    if would_create_cycle(graph, producer.members, consumer.members, members_of):
        return Refused.CYCLE, False
    return None, on_chip


def score(producer_index: int, consumer_index: int, records) -> int:
    """Bytes a merge along this edge can keep out of device memory: the producer's outputs
    that the consumer reads (written once and read once less)."""
    produced = records[producer_index]
    consumer_reads = set(records[consumer_index].reads)
    return sum(
        2 * nbytes
        for storage, nbytes in zip(produced.results, produced.cost.result_bytes)
        if storage is not None and storage in consumer_reads
    ) + sum(
        nbytes for storage, nbytes in zip(produced.writes, produced.cost.write_bytes) if storage in consumer_reads
    )


def group_key(members, records) -> tuple:
    """What identifies a group's kernel: its ops' signatures in order."""
    return tuple(records[index].signature for index in members)


def _chain_shape(members, window: WindowGraph) -> tuple:
    """What makes two groups the same chain for horizontal fusion: their ops in order and
    how data flows between them (shapes may differ, as in a multi-tensor kernel)."""
    records = window.records
    where = {index: offset for offset, index in enumerate(members)}
    produced_in = window.produced_in

    def source(storage) -> int:
        offset = produced_in(storage, where)
        return -1 if offset is None else offset

    return tuple((records[index].op, tuple(source(s) for s in records[index].reads)) for index in members)


def _fuse_horizontally(groups, group_of, window: WindowGraph, members_of) -> None:
    """Put independent copies of the same multi-op chain into one launch: a multi-tensor
    kernel, as an optimizer step issues the same short chain for every parameter. Legal
    when no path joins them (the cycle check); the ops still run in program order."""
    buckets: dict = {}
    for gid in sorted(groups, key=lambda g: min(groups[g].members)):
        group = groups[gid]
        if len(group.members) < 2 or group.matches:
            continue
        buckets.setdefault(_chain_shape(sorted(group.members), window), []).append(gid)
    for gids in buckets.values():
        if len(gids) < 2:
            continue
        head = groups[gids[0]]
        for gid in gids[1:]:
            other = groups[gid]
            if would_create_cycle(window.dependencies, head.members, other.members, members_of):
                continue
            head.members += other.members
            head.repeats += other.repeats
            del groups[gid]
            for index in other.members:
                group_of[index] = gids[0]


def plan_window(records, escapes, unfusable=frozenset(), kernel_cache=None, on_chip_bytes: int = 0,
                patterns: bool = True, every_op_fallible: bool = False, released=frozenset(),
                whole_window: bool = False) -> Plan:
    """Group the window's records into kernels.

    ``escapes(index, position)`` tells whether a record's output is still referenced from
    Python (or aliased by a view) at flush; those are written back to device memory.
    ``released``: storages written in place that nothing references at flush (their
    writes need not be written back when only the kernel touches them).
    ``every_op_fallible``: any op may fail (fault injection), so kernels keep program order.
    ``whole_window``: the window is one kernel, its ops in program order (a region that
    TorchNeuron's policy compiles whole, ``adaptive_eager/policies.py``): no patterns, no
    loop rules; what it writes back follows the same rules as any fused kernel.
    """
    count = len(records)
    window = WindowGraph(records, escapes, released, every_op_fallible)
    refusals: dict = {}
    if whole_window:
        members = tuple(range(count))
        if count > 1 and unfusable and group_key(members, records) in unfusable:
            refusals[Refused.FAILED_BEFORE] = 1  # it failed once as one kernel: op by op
            specs = [group_spec((index,), window, kernel_cache) for index in members]
        else:
            specs = [group_spec(members, window, kernel_cache)]
        return Plan(specs, refusals, records)
    kinds = [category(record.op) for record in records]
    graph = window.dependencies
    groups = {index: Group(index, kinds[index], records[index]) for index in range(count)}
    group_of = list(range(count))

    def members_of(node):
        return groups[group_of[node]].members

    if patterns:
        matches, pattern_refusals = find_patterns(window)
        for reason, count in pattern_refusals.items():
            refusals[reason] = refusals.get(reason, 0) + count
            LOG.debug("not matching %s (%d times)", reason, count)
        for match in matches:
            first = match.members[0]
            head = groups[first]
            for index in match.members[1:]:
                head.absorb(groups.pop(index), False)
                group_of[index] = first
            head.matches.append(match)
            _as_library_kernel(head, match, records)

    candidates = sorted(
        ((score(u, v, records), u, v) for u, v, kind in graph.edges(data="kind") if kind == "raw"),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    # Passes over the refused edges until one merges nothing: a merge refused for a
    # cycle may become legal once the ops on the cycle have joined the group (Inductor's
    # scheduler also loops until nothing changes).
    final: dict = {}  # (u, v) -> the reason of its last refusal
    while candidates:
        refused = []
        for item in candidates:
            _, u, v = item
            a, b = group_of[u], group_of[v]
            if a == b:
                final.pop((u, v), None)
                continue
            reason, on_chip = can_fuse(
                groups[a], groups[b], (u, v), kinds, records, graph, unfusable, members_of, on_chip_bytes
            )
            if reason is not None:
                final[(u, v)] = reason
                refused.append(item)
                continue
            final.pop((u, v), None)
            keep, gone = (a, b) if len(groups[a].members) >= len(groups[b].members) else (b, a)
            kept, merged = groups[keep], groups.pop(gone)
            kept.absorb(merged, on_chip)
            for index in merged.members:
                group_of[index] = keep
        candidates = refused if len(refused) < len(candidates) else []
    for (u, v), reason in final.items():
        if group_of[u] != group_of[v]:
            refusals[reason] = refusals.get(reason, 0) + 1
            LOG.debug("not fusing %s -> %s: %s", records[u].name, records[v].name, reason)

    _fuse_horizontally(groups, group_of, window, members_of)

    # launch order: a topological order of the groups, smallest first position first
    quotient = nx.DiGraph()
    quotient.add_nodes_from(groups)
    for u, v in graph.edges():
        if group_of[u] != group_of[v]:
            quotient.add_edge(group_of[u], group_of[v])
    order = nx.lexicographical_topological_sort(quotient, key=lambda gid: min(groups[gid].members))
    specs = [
        group_spec(sorted(groups[gid].members), window, kernel_cache, groups[gid].matches, groups[gid].repeats)
        for gid in order
    ]
    return Plan(specs, refusals, records)
