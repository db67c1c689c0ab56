"""The loop rules of the planner (``fusion/planner.py``), as a table: what a kernel that
streams its tensors through device memory can hold.

Entry points: :data:`LOOP_RULES` (the table: name, one-line doc, check) and
:func:`loop_rules` (producer group, consumer group, edge -> the first refusal, or None).
A rule's check reads a group's ``members``, ``anchor``, ``anchor_kind``, ``numels``,
``on_chip_only`` and ``matches`` (``planner.Group``) and returns a ``Refused`` reason.
"""
from __future__ import annotations

from adaptive_eager_device.core.reasons import Refused

from .categories import BARRIER, KERNEL, MATMUL, OPAQUE
from .patterns import KINDS as LIBRARY_KINDS


class LoopRule:
    """One loop rule: ``check`` returns a ``Refused`` reason, or None when the rule allows
    the merge. A rule over each group (``each_group``) is ``check(group, kinds, records)``;
    a rule over the pair is ``check(producer, consumer, edge, kinds, records)``."""

    __slots__ = ("name", "doc", "check", "each_group")

    def __init__(self, name: str, doc: str, check, each_group: bool = False) -> None:
        self.name, self.doc, self.check, self.each_group = name, doc, check, each_group


def _unknown_library_kernel(group, kinds, records):
    for match in group.matches:
        if match.name not in LIBRARY_KINDS:
            return Refused.LIBRARY_KERNEL.of(match.name)
    return None


def _opaque(group, kinds, records):
    for index in group.members:
        if kinds[index] in (OPAQUE, KERNEL, BARRIER):
            return Refused.OPAQUE.of(records[index].name)
    return None


def _off_chip(group, kinds, records):
    return Refused.OFF_CHIP if group.on_chip_only else None


def _anchored(producer, consumer):
    """The anchored one of two groups (at most one is: the two-anchors rule comes first)."""
    return producer if producer.anchor is not None else consumer if consumer.anchor is not None else None


def _two_anchors(producer, consumer, edge, kinds, records):
    if producer.anchor is not None and consumer.anchor is not None:
        return Refused.TWO_ANCHORS.of(f"{producer.anchor_kind} and {consumer.anchor_kind}")
    return None


def _pointwise_spaces(producer, consumer, edge, kinds, records):
    if _anchored(producer, consumer) is None and not (
        producer.numels <= consumer.numels or consumer.numels <= producer.numels or _broadcast_into(producer, consumer)
        or _within_tensor_group(producer, consumer) or _within_tensor_group(consumer, producer)
    ):
        return Refused.ITERATION_SPACES
    return None


def _within_tensor_group(group, other) -> bool:
    """Is each of ``group``'s iteration spaces one tensor of a multi-tensor (foreach)
    group that ``other`` loops over? Then the multi-tensor kernel's loop over that tensor
    holds it (a compiled AdamW step's ``fill_`` of each moment's lerp weight, read by
    ``_foreach_addcmul_``)."""
    tensors = {n for space in other.numels if type(space) is tuple for n in space[1]}
    return bool(tensors) and all(type(n) is int and n in tensors for n in group.numels)


def _matmul_prologue(producer, consumer, edge, kinds, records):
    anchored = _anchored(producer, consumer)
    if anchored is not None and anchored.anchor_kind == MATMUL and (edge[1] == anchored.anchor or any(
        LIBRARY_KINDS[match.name] == MATMUL and edge[1] in match.members for match in anchored.matches
    )):
        return Refused.MATMUL_PROLOGUE
    return None


def _anchored_spaces(producer, consumer, edge, kinds, records):
    anchored = _anchored(producer, consumer)
    if anchored is None:
        return None
    other = consumer if anchored is producer else producer
    if not (other.numels <= anchored.numels or (other is producer and _broadcast_into(producer, consumer))):
        return Refused.ITERATION_SPACES.of(f"around a {anchored.anchor_kind}")
    return None


# The loop rules; the first reason refuses the merge. The rules over each group are asked
# of the producer, then of the consumer, before the rules over the pair, in this order.
LOOP_RULES = (
    LoopRule("known_library_kernels", "every library kernel in the group has a kind (patterns.KINDS)",
             _unknown_library_kernel, each_group=True),
    LoopRule("no_opaque_op", "no opaque op and no barrier in the group", _opaque, each_group=True),
    LoopRule("streams_through_memory", "the group is none that only the on-chip rule allowed", _off_chip,
             each_group=True),
    LoopRule("one_anchor", "at most one of the two holds a reduction or matmul", _two_anchors),
    LoopRule("pointwise_spaces", "without an anchor: one's iteration spaces hold the other's, or the producer's "
             "broadcast into the consumer's, or each of one's is a tensor of the other's multi-tensor group",
             _pointwise_spaces),
    LoopRule("no_matmul_prologue", "the edge does not end at a matmul (it takes an epilogue only)", _matmul_prologue),
    LoopRule("anchored_spaces", "with an anchor: the other group's iteration spaces are the anchor's, or the "
             "producer's broadcast into the consumer's", _anchored_spaces),
)


# (check, the group it asks of: 0 the producer, 1 the consumer, None the pair), in order
_ASKED = tuple((rule.check, side) for side in (0, 1) for rule in LOOP_RULES if rule.each_group) + tuple(
    (rule.check, None) for rule in LOOP_RULES if not rule.each_group
)


def loop_rules(producer, consumer, edge, kinds, records) -> str | None:
    """What a kernel that streams its tensors through device memory can hold
    (``fusion/planner.py``'s docstring): the first refusal of :data:`LOOP_RULES`, or None.
    The rules (the first three asked of the producer, then of the consumer):
    """
    groups = (producer, consumer)
    for check, side in _ASKED:
        if side is None:
            reason = check(producer, consumer, edge, kinds, records)
        else:
            reason = check(groups[side], kinds, records)
        if reason is not None:
            return reason
    return None


loop_rules.__doc__ += "".join(f"\n    - {rule.name}: {rule.doc}" for rule in LOOP_RULES)


def _broadcast_into(producer, consumer) -> bool:
    """Is ``producer`` a pointwise group whose (fewer) elements its consumer may read
    broadcast, so the consumer's loop recomputes them, as Inductor inlines a pointwise
    producer (a position embedding added to each sequence, a scalar gradient scattered)?
    Each of its iteration spaces divides one of the consumer's."""
    if producer.anchor is not None or any(type(n) is not int or n == 0 for n in producer.numels):
        return False
    spaces = [m for m in consumer.numels if type(m) is int]
    return all(any(m % n == 0 and m > n for m in spaces) for n in producer.numels)
