"""The demo (python -m adaptive_eager.demo): strict, then adaptive eager, side by side, from
the runs' own statistics; the losses of both modes identical (and the CPU's); --mode runs one."""
from __future__ import annotations

import re

import adaptive_eager
from adaptive_eager import demo


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return line.strip()[len(label):].split()


def test_default_runs_both_modes_side_by_side(capsys):
    runs = {}
    real_run = demo.run

    def recording_run(mode, steps, log=print):
        runs[mode] = real_run(mode, steps, log)
        return runs[mode]

    demo.run = recording_run
    try:
        code = demo.main(["--steps", "3"])
    finally:
        demo.run = real_run
    out = capsys.readouterr().out
    assert code == 0
    assert "strict eager" in out and "adaptive eager" in out and "NEURON_ADAPTIVE_EAGER=1" in out
    strict, adaptive = runs["strict"]["stats"], runs["adaptive"]["stats"]
    assert (strict["mode"], adaptive["mode"]) == ("strict", "adaptive")
    # the table shows each run's own figures
    assert _row(out, "kernel launches")[:2] == [f"{strict['kernels_launched']:,}", f"{adaptive['kernels_launched']:,}"]
    assert _row(out, "aten ops issued")[:2] == [f"{strict['ops_recorded']:,}", f"{adaptive['ops_recorded']:,}"]
    assert _row(out, "simulated device time (ms)")[:2] == [
        f"{strict['device_time_us'] / 1000:,.2f}", f"{adaptive['device_time_us'] / 1000:,.2f}"]
    assert strict["ops_recorded"] == adaptive["ops_recorded"]  # the same program
    assert adaptive["kernels_launched"] < strict["kernels_launched"] and adaptive["fused_kernels"] > 0
    # losses: every step, strict == adaptive == CPU
    assert runs["strict"]["losses"] == runs["adaptive"]["losses"] == demo.train(3, device="cpu", log=lambda line: None)
    assert "strict and adaptive identical, bit for bit, at all 3 steps" in out
    assert "NEURON_SIM_LAUNCH_US" in out and "python -m adaptive_eager.stats strict.json adaptive.json" in out
    assert "python -m adaptive_eager.report" in out


def test_different_losses_fail_the_demo(capsys, monkeypatch):
    real_train = demo.train

    def drifting(steps, device="neuron", log=print):
        losses = real_train(steps, device=device, log=log)
        return [x + 1e-3 for x in losses] if adaptive_eager.is_enabled() else losses

    monkeypatch.setattr(demo, "train", drifting)
    assert demo.main(["--steps", "2"]) == 1
    assert "DIFFER" in capsys.readouterr().out


def test_one_mode_prints_its_statistics(capsys):
    assert demo.main(["--steps", "2", "--mode", "adaptive"]) == 0
    out = capsys.readouterr().out
    assert "in adaptive eager for 2 steps" in out and "neuron fusion statistics (mode: adaptive)" in out
    assert re.search(r"fused kernels\s+[1-9]", out)
    assert adaptive_eager.is_enabled()  # still adaptive: a NEURON_FUSION_STATS dump at exit names the mode


def test_help_has_no_raw_markup(capsys):
    try:
        demo.main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "--mode" in out
