"""The dependency graph of a window, and the one cycle check that guards every merge.

Entry points: :func:`build_graph` (window records -> ``networkx.DiGraph``) and
:func:`would_create_cycle`.

Nodes are record positions in the window. Edges say "must run after", with a ``kind``:

- ``raw``: reads a storage an earlier op wrote (data flow). An op that writes in place
  also reads what it writes (a record's ``reads`` hold every tensor argument), so this
  edge also orders two writes of one storage (write after write);
- ``war``: writes a storage an earlier op read (an in-place op after a reader);
- ``ordered``: the op's place in program order is observable, so it runs before every
  later op: it can fail on its data (``categories.fallible``: an index out of range) and a
  failure must drop exactly the ops issued after it, as in strict eager; or it draws from
  the device generator, and the order of draws fixes the numbers. With
  ``every_op_fallible`` (fault injection, which can strike any op) the window runs in
  program order.

Storage identity is the whole allocation: a view shares its base's storage, so an in-place
write through a view orders against every reader of the base (overlap is assumed).
"""
from __future__ import annotations

from collections import deque

import networkx as nx

from .categories import fallible


def build_graph(records, every_op_fallible: bool = False) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(records)))
    last_writer: dict = {}
    readers: dict = {}
    last_ordered = None

    def depend(before: int, after: int, kind: str) -> None:
        if before != after and not graph.has_edge(before, after):
            graph.add_edge(before, after, kind=kind)

    for index, record in enumerate(records):
        for storage in record.reads:
            writer = last_writer.get(storage)
            if writer is not None:
                depend(writer, index, "raw")
        for storage in record.writes:
            for reader in readers.get(storage, ()):
                depend(reader, index, "war")
        if last_ordered is not None:
            depend(last_ordered, index, "ordered")
        if every_op_fallible or fallible(record):
            last_ordered = index
        for storage in record.reads:
            readers.setdefault(storage, []).append(index)
        for storage in record.writes:
            last_writer[storage] = index
            readers[storage] = []
        for storage in record.results:
            if storage is not None:
                last_writer[storage] = index
                readers[storage] = []
    return graph


def would_create_cycle(graph: nx.DiGraph, group_a, group_b, members_of=None) -> bool:
    """Would merging the node sets ``group_a`` and ``group_b`` into one kernel create a
    cycle among kernels?

    A breadth-first search from the merged group's outside users: if it comes back into
    the group, some kernel outside would have to run both after and before it. Other
    groups are whole kernels: ``members_of(node)`` gives the nodes of the group a node
    belongs to (reaching one member of a kernel reaches all of it, since the kernel runs
    as one launch); by default every node is a group of its own.
    """
    merged = set(group_a) | set(group_b)
    seen = set()
    frontier = deque()

    def reach(node) -> None:
        for member in (members_of(node) if members_of is not None else (node,)):
            if member not in seen:
                seen.add(member)
                frontier.append(member)

    for node in merged:
        for successor in graph.successors(node):
            if successor not in merged:
                reach(successor)
    while frontier:
        node = frontier.popleft()
        for successor in graph.successors(node):
            if successor in merged:
                return True
            if successor not in seen:
                reach(successor)
    return False
