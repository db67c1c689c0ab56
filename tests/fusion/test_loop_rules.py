"""The loop rules' table (``fusion/rules.py``): the order its rules are asked in, which
decides the reason a refusal gives. What each rule fuses is in ``tests/fusion/test_fusion_rules.py``."""
from types import SimpleNamespace

from adaptive_eager.fusion.categories import OPAQUE, POINTWISE
from adaptive_eager.fusion.rules import LOOP_RULES, loop_rules
from adaptive_eager_device.core.reasons import Refused


def _group(member: int, on_chip_only: bool = False):
    return SimpleNamespace(members=[member], matches=[], on_chip_only=on_chip_only, anchor=None, anchor_kind=None,
                           numels={16})


def test_loop_rules_ask_the_producer_before_the_consumer():
    """The rules over one group are asked of the whole producer first: a producer only the
    on-chip rule allowed is refused as such even when the consumer holds an opaque op."""
    records = [SimpleNamespace(name="aten::mul"), SimpleNamespace(name="aten::nonzero")]
    kinds = [POINTWISE, OPAQUE]
    assert loop_rules(_group(0, on_chip_only=True), _group(1), (0, 1), kinds, records) == Refused.OFF_CHIP
    assert loop_rules(_group(0), _group(1), (0, 1), kinds, records) == Refused.OPAQUE.of("aten::nonzero")
    assert loop_rules(_group(0), _group(1), (0, 1), [POINTWISE, POINTWISE], records) is None


def test_loop_rules_docstring_lists_the_table():
    for rule in LOOP_RULES:
        assert f"- {rule.name}: {rule.doc}" in loop_rules.__doc__
