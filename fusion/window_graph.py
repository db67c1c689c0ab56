"""The facts of one planned window, gathered once, and the one cycle check that guards
every merge.

Entry points: :class:`WindowGraph` (window records -> their data flow and dependency
graph, built once per planned window, on a plan-cache miss) and
:func:`would_create_cycle`.

Everything the planner asks of a window is here, from one pass over its records: the
patterns (``matching.Context``), the greedy merge (the hazard edges, the cycle check) and
the kernel specs (``kernels.group_spec``: dead outputs, the kernel's signature, its
traffic) read it instead of walking the records again. What is a group's own (its
members' offsets, what crosses its boundary) stays with the group.

The dependency graph is a ``networkx.DiGraph``. Nodes are record positions in the window.
Edges say "must run after", with a ``kind``:

- ``raw``: reads a storage an earlier op wrote (data flow). An op that writes in place
  also reads what it writes (a record's ``reads`` hold every tensor argument), so this
  edge also orders two writes of one storage (write after write): no edge of its own;
- ``war``: writes a storage an earlier op read (an in-place op after a reader);
- ``ordered``: the op's place in program order is observable, so it runs before every
  later op: it can fail on its data (``categories.fallible``: an index out of range) and a
  failure must drop exactly the ops issued after it, as in strict eager; or it draws from
  the device generator, and the order of draws fixes the numbers. With
  ``every_op_fallible`` (fault injection, which can strike any op) the window runs in
  program order.

Storage identity is the whole allocation: a view shares its base's storage, so an in-place
write through a view orders against every reader of the base (overlap is assumed). Every
output is a fresh storage (``OpRecord.results``), so each has one producer.
"""
from __future__ import annotations

from collections import deque

import networkx as nx

from .categories import fallible


class WindowGraph:
    """One window's data flow, its escape bits and its dependency graph.

    - ``records``: the window, in program order;
    - ``producer``: storage -> (position, result index) of the op whose output it is;
    - ``readers``: storage -> positions reading it, in order, with repeats (an op reading
      it twice is there twice);
    - ``written``: storages written in place;
    - ``touched_by``: storage -> the set of positions reading, writing or producing it (an
      output every one of whose users is inside a kernel never leaves it);
    - ``escaping``: (position, result index) of the outputs still referenced at the flush
      (``escapes``), which are written back to device memory;
    - ``released``: written storages nothing references any more at the flush (a buffer
      autograd accumulated a gradient into and let go), whose writes need not be written
      back;
    - ``dependencies``: the ``networkx.DiGraph`` of hazard edges (module docstring).

    The escape bits are the caller's: the window reads them from its plan-cache key
    (``AdaptiveSink._escape_bits``), so a plan always matches the key it is cached under.
    A value's last use (where a kernel frees it from its registers) is the kernel's own
    (``kernels._build_spec``, in member offsets): a library kernel moves its chain's reads
    to the chain's last op.
    """

    __slots__ = ("records", "producer", "readers", "written", "touched_by", "escaping", "released", "dependencies")

    def __init__(self, records, escapes, released=frozenset(), every_op_fallible: bool = False) -> None:
        """``escapes(position, result index)``: is that output still referenced at flush;
        ``released``: the written storages that are not."""
        self.records = records
        self.producer: dict = {}
        self.readers: dict = {}
        self.written: set = set()
        self.touched_by: dict = {}
        self.escaping: set = set()
        self.released = released
        self.dependencies = nx.DiGraph()
        self.dependencies.add_nodes_from(range(len(records)))
        last_writer: dict = {}  # storage -> the last position writing or producing it
        since_write: dict = {}  # storage -> how many of its readers came before that
        edges = []  # (before, after, {"kind": ...}), in the order found
        last_ordered = None
        for position, record in enumerate(records):
            before = self._hazards(record, last_writer, since_write)
            if last_ordered is not None:
                before.setdefault(last_ordered, "ordered")
            edges.extend((earlier, position, {"kind": kind}) for earlier, kind in before.items())
            if every_op_fallible or fallible(record):
                last_ordered = position
            self._note(position, record, escapes, last_writer, since_write)
        self.dependencies.add_edges_from(edges)

    def _hazards(self, record, last_writer: dict, since_write: dict) -> dict:
        """The earlier positions ``record`` must run after, for its data: each with the
        kind of its first hazard (every position noted so far is earlier)."""
        before: dict = {}
        for storage in record.reads:  # read after write
            writer = last_writer.get(storage)
            if writer is not None:
                before.setdefault(writer, "raw")
        readers = self.readers
        for storage in record.writes:  # write after read: the readers since its last write
            for reader in readers.get(storage, ())[since_write.get(storage, 0):]:
                before.setdefault(reader, "war")
        return before

    def _note(self, position: int, record, escapes, last_writer: dict, since_write: dict) -> None:
        """Add one record's reads, writes and outputs to the window's facts."""
        readers, touched_by = self.readers, self.touched_by
        for storage in record.reads:
            seen = readers.get(storage)
            if seen is None:
                readers[storage] = [position]
            else:
                seen.append(position)
            touched = touched_by.get(storage)
            if touched is None:
                touched_by[storage] = {position}
            else:
                touched.add(position)
        for storage in record.writes:
            last_writer[storage] = position
            since_write[storage] = len(readers.get(storage, ()))
            self.written.add(storage)
            touched_by.setdefault(storage, set()).add(position)
        for index, storage in enumerate(record.results):
            if storage is not None:  # a fresh storage: no reader before it
                last_writer[storage] = position
                self.producer[storage] = (position, index)
                touched_by[storage] = {position}
                if escapes(position, index):
                    self.escaping.add((position, index))

    def escapes(self, position: int, index: int) -> bool:
        """Is output ``index`` of the op at ``position`` still referenced at the flush?"""
        return (position, index) in self.escaping

    def produced_in(self, storage, where: dict):
        """The offset, in a kernel whose positions map to offsets by ``where``, of the op
        producing ``storage``, or None if it comes from outside the kernel."""
        produced = self.producer.get(storage)
        return None if produced is None else where.get(produced[0])


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
