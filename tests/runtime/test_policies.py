"""Adaptive eager's two policies (``adaptive_eager/policies.py``): ours, and TorchNeuron's
own (``NEURON_ADAPTIVE_POLICY=torchneuron``). Each of TorchNeuron's rules has a test that
fails without it; both policies give strict eager's results; the comparison command and
the three-run report."""
import json
import os
import subprocess
import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager.report import render
from adaptive_eager.report_text import format_runs
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware.execution_queue import QUEUE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATMUL_LIKE = ("mm", "addmm", "bmm", "baddbmm", "convolution")


@pytest.fixture
def torchneuron(adaptive_mode, monkeypatch):
    """Adaptive eager under TorchNeuron's policy; the simulated host issues ops in no time,
    so each kernel launched alone deepens the simulated queue by one."""
    adaptive_eager.clear_caches()
    monkeypatch.setattr(CONFIG, "host_us_per_op", 0.0)
    with adaptive_eager.window_policy(policy="torchneuron") as policy:
        yield policy
    adaptive_eager.clear_caches()


def deepen_queue(x, kernels: int = 16):
    """Launch ``kernels`` ops while the queue is shallow (each alone), leaving more than the
    low-water mark of 15 kernels queued, then zero the statistics."""
    y = x
    for _ in range(kernels):
        y = y + 0
    assert QUEUE.backlog_kernels() > 15
    adaptive_eager.reset_stats()  # (it launches nothing and waits for nothing simulated)
    return y


def kernels() -> dict:
    """Launches per kernel name, everything recorded launched first (a sync point)."""
    torch.neuron.synchronize()
    return {name: v["launches"] for name, v in adaptive_eager.stats()["kernels"].items()}


def uploaded(*shape):
    x = torch.randn(*shape).to("neuron")
    torch.neuron.synchronize()
    return x


def test_a_region_never_continues_past_a_matmul_like_op(torchneuron):
    x, w = uploaded(8, 8), uploaded(8, 8)
    x = deepen_queue(x)
    h = (x * 2 + 1) @ w
    out = ((h * 3 + 1) @ w).relu()
    found = kernels()
    assert found == {"mul|add|mm": 2, "aten::relu": 1}, found
    for name in found:  # a matmul-like op, when a kernel holds one, is its last op
        ops = name.removeprefix("aten::").split("|")
        assert not any(op in MATMUL_LIKE for op in ops[:-1]), name
    assert adaptive_eager.stats()["flushes"]["by_reason"]["region_closed"] == 2
    cpu_x, cpu_w = x.cpu(), w.cpu()
    assert torch.equal(out.cpu(), ((((cpu_x * 2 + 1) @ cpu_w) * 3 + 1) @ cpu_w).relu())


def test_a_custom_kernel_runs_alone_under_torchneuron(torchneuron):
    """An NKI kernel (category KERNEL, one op) breaks its region: the ops before it and
    after it are launched apart from it, never compiled into one region with it."""
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def double(a):
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = deepen_queue(uploaded(128, 8))
    c = (double(x * 3) + 1).sin()
    found = kernels()
    assert found.get("nki::double") == 1, found
    assert not any("double" in name for name in found if name != "nki::double"), found  # alone
    reasons = adaptive_eager.stats()["flushes"]["by_reason"]
    assert any(reason.startswith("region_break: custom kernel") for reason in reasons), reasons
    assert torch.equal(c.cpu(), ((x.cpu() * 3) * 2 + 1).sin())


@pytest.mark.parametrize("write", [
    lambda a: a.add_(1),
    lambda a: torch.add(a, 1, out=a),
    lambda a: a.clone(),  # a non-compute kernel (a copy), not in place
], ids=["in_place", "out", "copy"])
def test_an_in_place_op_or_a_copy_is_never_fused_under_torchneuron(torchneuron, write):
    x = deepen_queue(uploaded(64))
    a = x * 2
    b = write(a)
    c = (b * 3).sin()
    found = kernels()
    breaking = [name for name in found if "|" not in name and name not in ("aten::mul",)]
    assert len(breaking) == 1 and found[breaking[0]] == 1, found  # it ran alone
    op = breaking[0].removeprefix("aten::")
    assert not any(op in name.split("|") for name in found if "|" in name), found
    assert found == {"aten::mul": 1, breaking[0]: 1, "mul|sin": 1}, found
    reasons = adaptive_eager.stats()["flushes"]["by_reason"]
    assert any(reason.startswith("region_break") for reason in reasons), reasons
    assert torch.equal(c.cpu(), (x.cpu() * 2 + (0 if op == "clone" else 1)).mul(3).sin())


def test_it_buffers_only_while_more_than_15_kernels_wait(adaptive_mode, monkeypatch):
    """With a host slower than its kernels the queue never holds more than 15: every op
    launches at once, as in strict eager."""
    x = uploaded(64)
    adaptive_eager.clear_caches()
    adaptive_eager.reset_stats()
    monkeypatch.setattr(CONFIG, "host_us_per_op", 50.0)  # each kernel (10 us) ends before the next op
    with adaptive_eager.window_policy(policy="torchneuron"):
        y = x
        for _ in range(40):
            y = y * 1.5 + 1
        stats = adaptive_eager.stats()
    assert stats["ops_recorded"] == stats["kernels_launched"] == 80 and stats["fused_kernels"] == 0
    y.cpu()


def test_it_holds_at_most_1024_ops(torchneuron):
    x = deepen_queue(uploaded(16))
    torchneuron.max_ops = 100  # NEURON_ADAPTIVE_WINDOW is ours: TorchNeuron's limit is its own
    y = x
    for _ in range(1100):
        y = y + 1
    torch.neuron.synchronize()
    stats = adaptive_eager.stats()
    assert stats["flushes"]["by_reason"]["window_full"] == 1
    assert sorted(n for n in (len(name.split("|")) for name in stats["kernels"])) == [76, 1024]
    expected = x.cpu()
    for _ in range(1100):
        expected = expected + 1
    assert torch.equal(y.cpu(), expected)


def test_deterministic_algorithms_turn_it_off(torchneuron):
    x = uploaded(64)
    torch.use_deterministic_algorithms(True)  # (a sync point: the queue is empty after it)
    try:
        x = deepen_queue(x)  # so that only the deterministic rule keeps ops from buffering
        y = ((x * 2).sin() + 1).relu()
        stats = adaptive_eager.stats()
    finally:
        torch.use_deterministic_algorithms(False)
    assert stats["kernels_launched"] == stats["ops_recorded"] == 4 and stats["fused_kernels"] == 0
    assert stats["flushes"]["by_reason"] == {}  # each op launched alone; nothing was buffered
    y.cpu()


def test_a_region_is_one_launch_and_plans_follow_the_policy(adaptive_mode, monkeypatch):
    """Two independent ops: two launches under ours (nothing joins them), one under
    TorchNeuron's (a region is compiled whole). The same window's cached plan is not
    reused across policies."""
    x, y = uploaded(32), uploaded(32)
    adaptive_eager.clear_caches()
    monkeypatch.setattr(CONFIG, "host_us_per_op", 0.0)
    launches = {}
    for policy in ("ours", "torchneuron", "ours"):
        with adaptive_eager.window_policy(policy=policy, min_ops=10**6):
            adaptive_eager.reset_stats()
            if policy == "torchneuron":
                deepen_queue(x)
            a, b = x * 2, y + 1
            launches.setdefault(policy, []).append(kernels())
            assert torch.equal(a.cpu(), x.cpu() * 2) and torch.equal(b.cpu(), y.cpu() + 1)
    assert launches["ours"] == [{"aten::mul": 1, "aten::add": 1}] * 2
    assert launches["torchneuron"] == [{"mul|add": 1}]


def _gpt_losses(policy, steps=2):
    from bench.workloads import build_gpt

    torch.manual_seed(0)
    if policy == "strict":
        adaptive_eager.disable()
        step = build_gpt("neuron")
        return [step() for _ in range(steps)], None
    adaptive_eager.enable()
    with adaptive_eager.window_policy(policy=policy):
        step = build_gpt("neuron")
        losses = [step() for _ in range(steps - 1)]
        adaptive_eager.reset_stats()
        losses.append(step())
        return losses, adaptive_eager.stats()


def test_results_are_equal_under_both_policies_and_strict_eager():
    sys.path.insert(0, ROOT)
    strict, _ = _gpt_losses("strict")
    ours, ours_stats = _gpt_losses("ours")
    theirs, their_stats = _gpt_losses("torchneuron")
    assert [x.item() for x in strict] == [x.item() for x in ours] == [x.item() for x in theirs]
    assert their_stats["policy"] == "torchneuron" and ours_stats["policy"] == "ours"
    # they group differently: TorchNeuron's regions end at every matmul and in-place op
    assert ours_stats["ops_recorded"] == their_stats["ops_recorded"]
    assert ours_stats["kernels_launched"] < their_stats["kernels_launched"] < their_stats["ops_recorded"]
    text = format_runs([ours_stats, their_stats], ["ours", "torchneuron"])
    assert "kernels launched" in text and "torchneuron: top kernels by simulated time" in text


SCRIPT = """
import torch
x = torch.arange(64.0).reshape(8, 8).to("neuron")
w = torch.ones(8, 8, device="neuron")
for _ in range(3):
    x = ((x * 0.5 + 1) @ w).relu()
    x.add_(1)
print(x.sum().item())
"""


def test_the_compare_command_runs_three_ways_and_the_report_shows_them(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    keep = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "adaptive_eager.compare", "--json", "--keep", str(keep),
                           "--html", str(tmp_path / "report.html"), str(script)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    runs = out["runs"]
    assert out["same_output"] is True
    assert [runs[n]["policy"] for n in ("strict", "ours", "torchneuron")] == [None, "ours", "torchneuron"]
    assert runs["strict"]["kernels_launched"] == runs["strict"]["ops_recorded"]
    assert runs["ours"]["kernels_launched"] < runs["strict"]["kernels_launched"]
    assert all(runs[n]["top_kernels"] for n in runs)
    dumps = [json.loads((keep / f"{n}.json").read_text()) for n in ("strict", "ours", "torchneuron")]
    page = (tmp_path / "report.html").read_text()
    assert page == render(dumps, ["strict.json", "ours.json", "torchneuron.json"])
    assert page.count('class="bar first"') == page.count('class="bar second"') == page.count('class="bar third"') == 3
    assert 'id="kernel-time"' in page or "No fused kernels" in page
    assert "adaptive, torchneuron" in page and 'id="flushes-1"' in page
