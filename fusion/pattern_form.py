"""The pattern form of the pattern library (``fusion/patterns.py``): a chain as a tree of
op nodes with captured arguments and constraints, and the one matcher that walks it.

Entry points: :class:`Pattern` (a table entry: tree, checks, constants, library kernel,
kind), :class:`Custom` (an entry whose chain a tree cannot say cleanly: its own matcher)
and the tree's nodes: :class:`Op`, :class:`Alt`, :class:`Arg`, :class:`Same`,
:class:`Is`, :class:`Dim`, :class:`Seq` and :data:`ANY`.

A pattern is a tree matched from a chain's last op (its root) back through the ops
producing its arguments, as tinygrad's UPat or Inductor's CallFunction/KeywordArg: an
:class:`Op` node stands for a record of the window, its children for that record's
arguments by index. Matching binds each named node to its window position and each
named capture to the argument found there (``bound``, one dict); a capture met again
must read the same tensor. :class:`Alt` tries alternatives in order and keeps the first
that matches (no backtracking once a later sibling fails).
"""
from __future__ import annotations

from .matching import Match, dims_of, same_ref

_NODES = "nodes"  # ``bound`` key: the matched (Op node, position) pairs, in matching order
_KW_DEFAULTS = {"alpha": 1}  # a keyword absent from a record has ATen's default


class _Any:
    """An argument the pattern does not constrain."""

    __slots__ = ()

    def match(self, ctx, value, bound) -> bool:
        return True


ANY = _Any()


class Op:
    """A record named ``op`` whose (whole, first) output is the value matched: produced
    in the window and not yet claimed by a match. ``args``: patterns of its arguments by
    index (literals stand for themselves: ``True``/``False``/``None`` by identity,
    numbers by ``==``); ``kwargs``: patterns of its keyword arguments. ``name`` binds its
    position; ``readers``: how often the window reads its output (an intermediate the
    chain owns); ``view``: also reached through a view that only reshapes its output;
    ``let``: constants bound when it matches (which alternative matched)."""

    __slots__ = ("op", "args", "kwargs", "name", "readers", "view", "let")

    def __init__(self, op: str, *args, name=None, kwargs=None, readers: int = 1, view: bool = False, let=None):
        self.op = op
        self.args = tuple(_pattern(arg) for arg in args)
        self.kwargs = tuple((key, _pattern(value)) for key, value in (kwargs or {}).items())
        self.name, self.readers, self.view, self.let = name, readers, view, let or {}

    @property
    def roots(self) -> tuple:
        """The op names a record must have to match this node."""
        return (self.op,)

    def match(self, ctx, value, bound) -> bool:
        position = ctx.source_of(value, self.op, self.view)
        return position is not None and self.match_at(ctx, position, bound)

    def match_at(self, ctx, position: int, bound) -> bool:
        """Does the record at ``position`` match this node (binding into ``bound``)?"""
        record = ctx.records[position]
        if record.op._schema.name != self.op:
            return False
        if self.name is not None:
            bound[self.name] = position
        bound[_NODES] = bound.get(_NODES, ()) + ((self, position),)
        bound.update(self.let)
        args = record.args
        for index, pattern in enumerate(self.args):
            if pattern is not ANY and not pattern.match(ctx, args[index] if index < len(args) else None, bound):
                return False
        for key, pattern in self.kwargs:
            if not pattern.match(ctx, record.kwargs.get(key, _KW_DEFAULTS.get(key)), bound):
                return False
        return True


class Alt:
    """The first of ``patterns`` that matches the value."""

    __slots__ = ("patterns",)

    def __init__(self, *patterns) -> None:
        self.patterns = patterns

    def match(self, ctx, value, bound, at=None) -> bool:
        for pattern in self.patterns:
            trial = dict(bound)
            if pattern.match_at(ctx, at, trial) if at is not None else pattern.match(ctx, value, trial):
                bound.update(trial)
                return True
        return False

    def match_at(self, ctx, position: int, bound) -> bool:
        return self.match(ctx, None, bound, at=position)

    @property
    def roots(self) -> tuple:
        return tuple(dict.fromkeys(op for pattern in self.patterns for op in pattern.roots))


class Arg:
    """Any argument passing ``test``, captured as ``name``: a capture already bound must
    read the same tensor (:func:`same_ref`)."""

    __slots__ = ("name", "test")

    def __init__(self, name=None, test=None) -> None:
        self.name, self.test = name, test

    def match(self, ctx, value, bound) -> bool:
        if self.test is not None and not self.test(value):
            return False
        if self.name is None:
            return True
        if self.name in bound:
            return same_ref(bound[self.name], value)
        bound[self.name] = value
        return True


class Same:
    """The (whole, first) output of the node already bound as ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def match(self, ctx, value, bound) -> bool:
        return ctx.source_of(value) == bound[self.name]


class Is:
    """The value itself (``True``, ``False``, ``None``: by identity; else by ``==``)."""

    __slots__ = ("values",)

    def __init__(self, *values) -> None:
        self.values = values

    def match(self, ctx, value, bound) -> bool:
        return any(value is v if v is None or type(v) is bool else value == v for v in self.values)


class Dim:
    """A reduction's ``dim``: one dim, captured as ``name`` (and equal where bound), or
    exactly the dims ``dims``."""

    __slots__ = ("name", "dims")

    def __init__(self, name: str | None = None, dims: tuple | None = None) -> None:
        self.name, self.dims = name, dims

    def match(self, ctx, value, bound) -> bool:
        dims = dims_of(value)
        if self.name is None:
            return dims == self.dims
        if dims is None or len(dims) != 1:
            return False
        return bound.setdefault(self.name, dims[0]) == dims[0]


class Seq:
    """A list argument (``cat``'s tensors) of exactly these element patterns."""

    __slots__ = ("patterns",)

    def __init__(self, *patterns) -> None:
        self.patterns = tuple(_pattern(p) for p in patterns)

    def match(self, ctx, value, bound) -> bool:
        if not isinstance(value, (list, tuple)) or len(value) != len(self.patterns):
            return False
        return all(p is ANY or p.match(ctx, v, bound) for p, v in zip(self.patterns, value))


def _pattern(value):
    """A pattern as written in a tree: literals stand for themselves."""
    if value is None or type(value) in (bool, int, float):
        return Is(value)  # (ANY is no literal)
    return value


class Pattern:
    """One entry of the pattern table: a tree rooted at the chain's last op and what a
    match of it becomes.

    ``guard(ctx, bound)``: checks beyond the tree (shapes, dtypes, places). ``inputs``,
    ``outputs``: ``(node, index)`` pairs (a node the match did not bind is skipped);
    ``exports``: nodes whose output the chain may own while it is needed after it (the
    kernel then writes it back too, in this order); ``checks``: ``(node, arg index,
    value)``, the value a number or the name of a capture, re-checked at every launch;
    ``constants(ctx, bound)``: the keyword arguments of ``impl`` (``bound["exported"]``
    names the exports written back); ``charges(ctx, bound)``: ``(node, index, bytes)``
    as :class:`Match` takes them, by node. ``impl`` is the library kernel, unless the
    match binds one (``let={"impl": ...}``: a variant). ``kind``: what the kernel is to
    the loop rules (``fusion/planner.py``)."""

    def __init__(self, name, tree, impl, kind, doc, inputs, outputs=(("root", 0),), exports=(), checks=(),
                 guard=None, constants=None, charges=None) -> None:
        self.name, self.tree, self.impl, self.kind, self.doc = name, tree, impl, kind, doc
        self.inputs, self.outputs, self.exports, self.checks = inputs, outputs, exports, checks
        self.guard, self.constants, self.charges = guard, constants, charges
        self.roots = tree.roots  # the op names its chain may end with

    def match(self, ctx, root: int):
        """A :class:`Match` at ``root``, a refusal reason (the chain is there but not
        its own), or None."""
        bound = {"root": root}
        if not self.tree.match_at(ctx, root, bound) or (self.guard is not None and not self.guard(ctx, bound)):
            return None
        for node, position in bound[_NODES]:
            if position == root:
                continue
            owned = (
                ctx.exportable(position, node.readers, root) if node.name in self.exports
                else ctx.private(position, node.readers)
            )
            if not owned:
                return "intermediate escapes or is shared"
        exported = [name for name in self.exports if name in bound and ctx.needed_after(bound[name], root)]
        bound["exported"] = exported
        return Match(
            self.name,
            [position for _, position in bound[_NODES]],
            bound.get("impl", self.impl),
            [(bound[node], index) for node, index in self.inputs if node in bound],
            [(bound[node], index) for node, index in self.outputs] + [(bound[name], 0) for name in exported],
            [(bound[node], index, bound[value] if type(value) is str else value)
             for node, index, value in self.checks if node in bound],
            self.constants(ctx, bound) if self.constants is not None else None,
            [(bound[node], index, nbytes) for node, index, nbytes in self.charges(ctx, bound)]
            if self.charges is not None else (),
        )


class Custom:
    """A table entry whose chain a tree cannot say cleanly: ``matcher(ctx, root)`` returns
    what :meth:`Pattern.match` does, for a chain ending with one of the ops ``roots``."""

    def __init__(self, name, matcher, kind, doc, roots) -> None:
        self.name, self.matcher, self.kind, self.doc, self.roots = name, matcher, kind, doc, tuple(roots)

    def match(self, ctx, root: int):
        return self.matcher(ctx, root)
