"""bench/realtime.py, the wall-clock bench against CPU eager (``python -m bench --realtime``):
its quick path runs on tiny Hugging Face models, writes the JSON the table comes from, and
its correctness checks pass; a result that differs from the CPU's is caught and shown.
No timing is asserted: speed is read from the bench, never from a test."""
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import realtime  # noqa: E402


def _quick(tmp_path, workload: str, modes: str) -> dict:
    path = tmp_path / f"{workload}.json"
    status = realtime.main(["--quick", "--size", "tiny", "--in-process", "--workloads", workload, "--modes", modes,
                            "--out", str(path)])
    report = json.loads(path.read_text())
    assert status == 0 and report["all_checks_ok"] is True
    assert report["taken"]["commit"] is not None and report["size"] == "tiny" and set(report["results"]) == {workload}
    by_mode = report["results"][workload]
    assert set(by_mode) == set(modes.split(","))
    for mode, r in by_mode.items():
        assert "error" not in r, (mode, r)
        assert r["check"]["ok"] and r["check"]["pairs"] == 4, (mode, r["check"])  # 1 warmup + 3 timed pairs
        assert len(r["ratios"]) == 3 and r["x_cpu"] > 0 and r["cpu_ms"] > 0 and r["first_step_ms"] > 0
        assert r["torch_threads"] == 1
        assert r["page_faults"] >= 0 and r["system_ms"] >= 0 and r["cpu_page_faults"] >= 0  # getrusage per step
        stats = r["neuron_per_step"]
        assert stats["ops_recorded"] > 0
        if mode == "compiled":  # the graphs ran: no silent fall back to eager
            assert stats["graph_calls"] >= 1
        else:
            assert not stats["graph_calls"]
    return by_mode


def test_the_quick_path_on_tiny_models_writes_the_table_and_matches_the_cpu(tmp_path):
    # Compiled training (torch.compile of a whole HF model, forward and backward) takes
    # 15-20 s even tiny, so this fast test leaves it to the bench (tests/test_compile.py
    # checks compiled training steps against the CPU).
    generate = _quick(tmp_path, "generate", "strict,adaptive,compiled")
    # the prompt plus every new token: 1 prefill + 3 decoding steps, each one graph call
    assert generate["compiled"]["neuron_per_step"]["graph_calls"] == realtime.SIZES["tiny"]["new_tokens"]
    _quick(tmp_path, "llama-train", "strict,adaptive")


def test_a_result_that_differs_from_the_cpu_fails_the_check(monkeypatch):
    build = realtime.build

    def off_by_one(workload, mode, size):
        step, cpu_step = build(workload, mode, size)
        return (lambda: step() + 1), cpu_step

    monkeypatch.setattr(realtime, "build", off_by_one)
    result = realtime.measure("generate", "strict", steps=1, warmup=0, size_name="tiny")
    assert result["check"]["ok"] is False and "token ids differ" in result["check"]["failures"][0]
    lines = "\n".join(realtime.table({"generate": {"strict": result}}, ["strict"], first_step=False))
    assert "MISMATCH" in lines and "RESULTS DIFFER FROM CPU EAGER" in lines


def test_compare_losses_within_tolerance_only():
    size = realtime.SIZES["tiny"]
    assert realtime.compare("gpt2-train", torch.tensor(2.0), torch.tensor(2.0 + 1e-6), size)[0]
    assert not realtime.compare("gpt2-train", torch.tensor(2.0), torch.tensor(2.01), size)[0]
    short = torch.arange(size["prompt"] + 1).unsqueeze(0)  # stopped after one new token
    assert not realtime.compare("generate", short, short.clone(), size)[0]
