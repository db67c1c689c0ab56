"""bench/scaling.py's figures at the smallest size: the roofline bound is a lower bound
no mode beats, and the bench runs end to end (the full sweep is ``python bench/scaling.py``)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import scaling  # noqa: E402


@pytest.mark.parametrize("workload", ["gpt", "llama", "decode"])
def test_no_mode_beats_the_roofline_bound(workload):
    bound = scaling.roofline(workload, 64)
    assert bound["bound_us"] == max(bound["compute_us"], bound["memory_us"]) > 0
    assert bound["compulsory_bytes"] >= bound["weight_bytes"]
    figures = {mode: scaling.measure_one(workload, 64, mode) for mode in ("strict", "adaptive")}
    for mode, measured in figures.items():
        # every kernel pays at least its own roofline, so a step cannot beat the step's
        assert measured["device_time_us"] - measured["launches"] * measured["launch_overhead_us"] >= bound["bound_us"], mode
    assert figures["adaptive"]["launches"] < figures["strict"]["launches"]
    assert figures["adaptive"]["ops"] == figures["strict"]["ops"]
