"""What docs/PATTERNS.md ("In training") claims from bench/patterns.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.patterns import measure  # noqa: E402


def test_patterns_in_training_and_backward_chains(adaptive_mode):
    rows = {(row["form"], row["rules"]): row for row in measure()}
    matched = {form for (form, rules), row in rows.items() if rules == "loop rules" and row["patterns"]}
    # in training: the forms whose library kernel gives back what autograd keeps, or that keep nothing
    assert matched == {"rms_norm", "linear_bias", "attention", "rotary"}
    for (form, rules), row in rows.items():
        assert row["patterns"] in ([], [form])
        if rules == "on-chip rule":  # generic fusion covers every backward chain
            assert row["backward_launches"] == 1 and row["forward_launches"] == 1, form
        else:
            assert 1 <= row["backward_launches"] <= 7, form
