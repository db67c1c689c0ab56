"""The machinery of the pattern library (``fusion/patterns.py``): what a matcher asks
about a window, what a match is, and where a matched chain sits in a kernel. The pattern
form that asks it is in ``fusion/pattern_form.py``.

Entry points: :class:`Context` (a window's data flow for matchers, read from its
``WindowGraph``), :class:`Match` (a matched chain by window positions),
and its ``spec``: the same chain by offsets inside its fused kernel, a ``PatternSpec`` of
the plan format (``device/hardware/plan.py``).
"""
from __future__ import annotations

from adaptive_eager_device.hardware.plan import PatternSpec
from adaptive_eager_device.memory.storage import DeviceStorage, ViewRef


class Match:
    """A matched chain, by window positions (the planner places it in a kernel)."""

    __slots__ = ("name", "members", "impl", "inputs", "outputs", "checks", "constants", "charges")

    def __init__(self, name, members, impl, inputs, outputs, checks=(), constants=None, charges=()) -> None:
        self.name = name
        self.members = tuple(sorted(set(members)))
        self.impl = impl
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.checks = tuple(checks)
        self.constants = constants or {}
        # ((position, result index, bytes), ...): an export the modelled library kernel
        # does not write back whole (a flash kernel's scores: it writes their row
        # log-sum-exp, and its backward recomputes them), charged at ``bytes`` instead;
        # ``~argument index`` in place of the result index: an input it does not read whole
        self.charges = tuple(charges)

    def spec(self, kernel_members) -> PatternSpec:
        """This match inside the kernel whose window positions are ``kernel_members``."""
        offset = {position: index for index, position in enumerate(kernel_members)}
        return PatternSpec(
            self.name,
            self.impl,
            tuple(offset[p] for p in self.members),
            tuple((offset[p], a) for p, a in self.inputs),
            tuple((offset[p], r) for p, r in self.outputs),
            tuple((offset[p], a, v) for p, a, v in self.checks),
            self.constants,
            tuple((offset[p], r, nbytes) for p, r, nbytes in self.charges),
        )


class Context:
    """What matchers ask about a window."""

    def __init__(self, graph) -> None:
        """``graph``: the window's ``WindowGraph`` (``fusion/window_graph.py``)."""
        self.records = graph.records
        self.escapes = graph.escapes  # (position, result index) -> still referenced at flush?
        self.producer = graph.producer  # storage -> (position, result index)
        self.readers = graph.readers  # storage -> [positions reading it, with repeats]
        self.written = graph.written  # storages written in place in the window
        self.claimed: set = set()

    def name(self, position: int) -> str:
        return self.records[position].op._schema.name

    def arg(self, position: int, index: int, default=None):
        args = self.records[position].args
        return args[index] if index < len(args) else default

    def producer_of(self, storage, op_name: str | None = None):
        """Position of the unclaimed record whose first output is ``storage`` (by
        ``op_name``), if this window produces it."""
        produced = self.producer.get(storage)
        if produced is None or produced[1] != 0 or produced[0] in self.claimed:
            return None
        if op_name is not None and self.name(produced[0]) != op_name:
            return None
        return produced[0]

    def source_of(self, ref, op_name: str | None = None, reshaped: bool = False):
        """Position of the record whose (whole, first) output the recorded argument
        ``ref`` is, if it is produced in this window (by ``op_name``); ``reshaped``: also
        through a view that only reshapes that whole output."""
        if type(ref) is DeviceStorage:
            return self.producer_of(ref, op_name)
        if not reshaped or type(ref) is not ViewRef:
            return None
        storage = ref.storage
        if ref.offset != 0 or _numel(ref.shape) != _numel(storage.shape) or not (
            _contiguous(ref.shape, ref.stride) and _contiguous(storage.shape, storage.stride)
        ):
            return None
        return self.producer_of(storage, op_name)

    def source(self, position: int, index: int, op_name: str | None = None):
        """Position of the record whose (whole, first) output is argument ``index`` of the
        record at ``position``, if it is produced in this window (by ``op_name``)."""
        return self.source_of(self.arg(position, index), op_name)

    def source_reshaped(self, position: int, index: int, op_name: str | None = None):
        """As :meth:`source`, seeing through a view that only reshapes the whole output
        (matmul's ``expand``/``reshape``/``_unsafe_view`` around ``bmm``)."""
        return self.source_of(self.arg(position, index), op_name, reshaped=True)

    def private(self, position: int, readers: int) -> bool:
        """Is the output of ``position`` an intermediate the chain owns: read exactly
        ``readers`` times in the window, never written in place, not escaping, not viewed?"""
        storage = self.records[position].results[0]
        if storage is None or storage in self.written or self.escapes(position, 0):
            return False
        return len(self.readers.get(storage, ())) == readers

    def exportable(self, position: int, readers: int, root: int) -> bool:
        """May the chain ending at ``root`` own the output of ``position`` while it is
        needed after the chain (it escapes, or ops after ``root`` read it): read exactly
        ``readers`` times up to ``root``, never written in place? The library
        kernel then writes it back too (autograd keeps such values for backward)."""
        storage = self.records[position].results[0]
        if storage is None or storage in self.written:
            return False
        return sum(1 for reader in self.readers.get(storage, ()) if reader <= root) == readers

    def needed_after(self, position: int, root: int) -> bool:
        """Is the output of ``position`` needed after the chain ending at ``root``?"""
        storage = self.records[position].results[0]
        return self.escapes(position, 0) or any(reader > root for reader in self.readers.get(storage, ()))

    def same(self, a: int, ai: int, b: int, bi: int) -> bool:
        return same_ref(self.arg(a, ai), self.arg(b, bi))


def same_ref(a, b) -> bool:
    """Do two recorded arguments read the same tensor? A storage is itself; a view is its
    place in a storage (each op records its own ``ViewRef``), compared by value."""
    if a is b:
        return True
    return (
        type(a) is ViewRef and type(b) is ViewRef and a.storage is b.storage and a.offset == b.offset
        and a.shape == b.shape and a.stride == b.stride
    )


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _contiguous(shape, stride) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def dims_of(value):
    """A reduction's ``dim`` argument as a tuple (None for all dims)."""
    if isinstance(value, int):
        return (value,)
    return tuple(value) if value is not None else None
