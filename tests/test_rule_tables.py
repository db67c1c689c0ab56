"""The pattern table's form and the loop rules' table: what their matchers promise
beyond a pattern's own tests (``tests/test_patterns.py``, ``tests/test_fusion_rules.py``)."""
from types import SimpleNamespace

import pytest
import torch

import adaptive_eager
from adaptive_eager.fusion.categories import OPAQUE, POINTWISE
from adaptive_eager.fusion.rules import LOOP_RULES, loop_rules
from adaptive_eager_device.reasons import Refused
from conftest import assert_same, windows_at_sync_points


@pytest.fixture(autouse=True)
def policy(adaptive_mode):
    yield from windows_at_sync_points(on_chip_bytes=0, patterns=True)


def on_device(*tensors):
    out = [t.to("neuron") for t in tensors]
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    return out


def test_a_capture_met_again_must_be_the_same_tensor():
    """x * sigmoid(y) is no SiLU: the tree's two ``x`` captures read different tensors."""
    x, y = torch.randn(32), torch.randn(32)
    dx, dy = on_device(x, y)
    assert_same(dx * torch.sigmoid(dy), x * torch.sigmoid(y))
    assert adaptive_eager.stats()["patterns"] == {}


def test_an_alternative_matches_when_the_first_does_not():
    """sigmoid(x) * x: SiLU's second alternative (the gate as the first argument)."""
    x = torch.randn(32)
    (d,) = on_device(x)
    assert_same(torch.sigmoid(d) * d, torch.sigmoid(x) * x, rtol=1e-6, atol=1e-7)
    assert adaptive_eager.stats()["patterns"] == {"silu": {"matched": 1, "ops": 2}}


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
