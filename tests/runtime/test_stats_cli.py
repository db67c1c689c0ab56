"""The statistics CLI (python -m adaptive_eager.stats), the metrics API and the logging
hierarchy, on real dumps from a strict and an adaptive run of the same training loop."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager import logs
from adaptive_eager.report_text import STATS_VERSION, load, main, short_name

# The same small training loop in both modes: an MLP (with a hand-written SiLU) trained
# with AdamW and grad clipping, a data-dependent op (nonzero: a sync point) each step, and an op the device lacks (geqrf:
# CPU fallback) at the end.
LOOP = r"""
import torch, torch.nn as nn, torch.nn.functional as F
import adaptive_eager
class SiLU(nn.Module):  # written by hand, as people do: a library pattern in adaptive eager
    def forward(self, x):
        return x * torch.sigmoid(x)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), SiLU(), nn.Linear(32, 4)).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(6):
    x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    hard = (y == 3).nonzero()
    with torch.no_grad():  # evaluation: nothing kept for backward, so SiLU's chain matches
        accuracy = (model(x).argmax(-1) == y).float().mean()
    print(f"{step} {loss.item():.6f} {hard.numel()} {accuracy.item():.3f}")
q, tau = torch.geqrf(torch.randn(4, 3).to("neuron"))
"""


def run_loop(directory, mode: str, extra_env=None, script: str = LOOP) -> subprocess.CompletedProcess:
    """Run the loop in a fresh process: strict or adaptive, with statistics and trace files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
    env.update(
        NEURON_ADAPTIVE_EAGER="1" if mode == "adaptive" else "0",
        NEURON_FUSION_STATS=str(directory / f"{mode}.json"),
        NEURON_TRACE=str(directory / f"{mode}_trace.json"),
        **(extra_env or {}),
    )
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)


def make_runs(directory) -> dict:
    """Dumps and traces of both modes in ``directory`` (made once, shared by test modules;
    the two processes run side by side)."""
    directory.mkdir(parents=True, exist_ok=True)
    missing = [mode for mode in ("strict", "adaptive") if not (directory / f"{mode}.json").exists()]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for mode, result in zip(missing, pool.map(lambda mode: run_loop(directory, mode), missing)):
            (directory / f"{mode}.out").write_text(result.stdout)
            (directory / f"{mode}.err").write_text(result.stderr)
    out = {}
    for mode in ("strict", "adaptive"):
        out[mode] = directory / f"{mode}.json"
        out[f"{mode}_trace"] = directory / f"{mode}_trace.json"
        out[f"{mode}_stdout"] = (directory / f"{mode}.out").read_text()
        out[f"{mode}_stderr"] = (directory / f"{mode}.err").read_text()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return make_runs(tmp_path_factory.getbasetemp() / "training_runs")


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def section(text: str, title: str) -> list[str]:
    """The table rows printed under the line starting with ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        rows.append(line.strip())
    return [row for row in rows if not set(row) <= set("- ")]


KERNEL_NAME = re.compile(r"^(?:(\w+)\()?(.+?)(?: x(\d+))?\)?$")  # [pattern(]a|b|c[ xN][)]


def ops_in(kernel: str) -> int:
    """How many ops one launch of the named kernel runs."""
    _, chain, copies = KERNEL_NAME.match(kernel).groups()
    return len(chain.split("|")) * int(copies or 1)


def cells(row: str) -> list[str]:
    """A table row's cells (kernel names may hold single spaces: " ... ")."""
    return re.split(r"\s{2,}", row.strip())


# -- the dumps themselves --------------------------------------------------------------------
def test_same_loop_in_both_modes(runs):
    strict, adaptive = load(runs["strict"]), load(runs["adaptive"])
    assert runs["strict_stdout"] == runs["adaptive_stdout"] and runs["strict_stdout"].count("\n") == 6  # same losses
    assert (strict["mode"], adaptive["mode"]) == ("strict", "adaptive")
    assert strict["ops_recorded"] == adaptive["ops_recorded"] > 100
    assert strict["kernels_launched"] == strict["ops_recorded"] and strict["fused_kernels"] == 0
    assert 0 < adaptive["fused_kernels"] < adaptive["kernels_launched"] < adaptive["ops_recorded"]
    assert strict["fallback_ops"] == adaptive["fallback_ops"] == {"aten::geqrf": 1}
    assert adaptive["flushes"]["by_reason"]["data_dependent: aten::nonzero"] == 6
    assert strict["patterns"] == {} and adaptive["patterns"]["silu"] == {"matched": 6, "ops": 12}
    # the per-kernel table adds up to the totals (launches: at most, as data-dependent ops
    # run on the host after a sync and count as launched without a "kernels" entry)
    for data in (strict, adaptive):
        assert sum(k["launches"] for k in data["kernels"].values()) <= data["kernels_launched"]
        assert sum(k["time_us"] for k in data["kernels"].values()) == pytest.approx(data["device_time_us"], abs=0.01)
        fused = {name: k for name, k in data["kernels"].items() if ops_in(name) > 1}
        assert sum(k["launches"] for k in fused.values()) == data["fused_kernels"]
        assert sum(k["launches"] * ops_in(name) for name, k in fused.items()) == data["ops_fused"]


# -- one dump as a table -----------------------------------------------------------------------
def test_table_of_an_adaptive_run(runs, capsys):
    data = load(runs["adaptive"])
    code, out, err = cli(capsys, runs["adaptive"])
    assert code == 0 and err == ""
    assert out.startswith("neuron fusion statistics (mode: adaptive)")
    assert re.search(rf"kernels launched\s+{data['kernels_launched']} \(", out)
    assert re.search(rf"launches saved\s+{data['ops_recorded'] - data['kernels_launched']}\n", out)
    # flushes by reason, most frequent first, with their counts and meaning
    flushes = section(out, "flushes by reason")
    expected = sorted(data["flushes"]["by_reason"].items(), key=lambda x: (-x[1], x[0]))
    assert [cells(row)[:2] for row in flushes] == [[r, str(n)] for r, n in expected]
    assert ["data_dependent: aten::nonzero", "6", "op with a data-dependent output shape"] in map(cells, flushes)
    # fused kernels: sorted by simulated time (the dump's "kernels" object is sorted by name)
    fused = sorted(((k["time_us"], name, k) for name, k in data["kernels"].items() if ops_in(name) > 1), key=lambda x: (-x[0], x[1]))
    rows = [cells(row) for row in section(out, "top fused kernels by simulated time")[1:]]  # [1:]: the header
    assert len(rows) == min(10, len(fused))
    for row, (time_us, name, kernel) in zip(rows, fused):
        assert row[:3] + row[4:] == [str(ops_in(name)), str(kernel["launches"]), f"{time_us:.1f}", name]  # the whole name
    launches = [int(row[1]) for row in map(cells, section(out, "top fused kernels by launches")[1:])]
    assert launches == sorted(launches, reverse=True) and launches[0] == max(k["launches"] for _, _, k in fused)
    refusals = [cells(row) for row in section(out, "fusions refused, by reason")]
    assert [row[:2] for row in refusals] == [[r, str(n)] for r, n in sorted(data["refusals"].items(), key=lambda x: (-x[1], x[0]))]
    assert ["pattern: silu, intermediate escapes or is shared", str(data["refusals"]["pattern: silu, intermediate escapes or is shared"]),
            "the chain looks like this pattern, but an intermediate is used elsewhere (e.g. kept for backward)"] in refusals
    assert [cells(row) for row in section(out, "CPU fallback ops (1)")] == [["aten::geqrf", "1"]]
    cache = data["plan_cache"]
    rate = 100 * cache["hits"] / (cache["hits"] + cache["misses"])
    assert re.search(rf"plan cache\s+hit rate\s+{rate:.1f}%\s+\({cache['hits']} hits, {cache['misses']} misses", out)
    patterns = [cells(row) for row in section(out, "patterns matched")[1:]]
    assert patterns == [[name, str(v["matched"]), str(v["ops"])] for name, v in sorted(data["patterns"].items())]
    assert ["silu", "6", "12"] in patterns


def test_table_of_a_strict_run(runs, capsys):
    data = load(runs["strict"])
    code, out, _ = cli(capsys, runs["strict"])
    assert code == 0 and "(mode: strict)" in out
    assert "flushes: none (strict eager has no op window)" in out and "fused kernels: none" in out
    assert "patterns matched: none recorded" in out
    singles = section(out, "top single-op kernels by simulated time")[1:]
    top = max(data["kernels"].items(), key=lambda item: item[1]["time_us"])
    cells_of_top = singles[0].split()
    assert cells_of_top[:2] + cells_of_top[4:] == ["1", str(top[1]["launches"]), top[0]]
    assert re.search(r"kernel cache\s+hit rate\s+-\s+\(0 hits, 0 misses", out)


def test_side_by_side_with_ratios(runs, capsys):
    strict, adaptive = load(runs["strict"]), load(runs["adaptive"])
    code, out, _ = cli(capsys, runs["strict"], runs["adaptive"])
    assert code == 0
    header = out.splitlines()[0]
    rows = {cells(line)[0]: cells(line)[1:] for line in out.splitlines()[2:] if "  " in line}
    assert "(strict)" in header and "(adaptive)" in header and header.rstrip().endswith("ratio")
    ratio = adaptive["kernels_launched"] / strict["kernels_launched"]
    assert rows["kernels launched"] == [str(strict["kernels_launched"]), str(adaptive["kernels_launched"]), f"{ratio:.3f}"]
    assert rows["ops recorded"] == [str(strict["ops_recorded"])] * 2 + ["1.000"]
    assert rows["device time (ms)"][2] == f"{adaptive['device_time_us'] / strict['device_time_us']:.3f}"
    assert rows["fused kernels"] == ["0", str(adaptive["fused_kernels"]), "-"]  # no ratio against zero
    assert f"launches: {1 / ratio:.2f}x fewer in the second" in out


def test_json_summary_and_comparison(runs, capsys):
    data = load(runs["adaptive"])
    code, out, _ = cli(capsys, runs["adaptive"], "--json", "--top", "3")
    assert code == 0
    summary = json.loads(out)
    assert summary["kernels_launched"] == data["kernels_launched"]
    assert summary["launches_saved"] == data["ops_recorded"] - data["kernels_launched"]
    assert summary["fallback_ops"] == {"aten::geqrf": 1}
    times = [k["time_us"] for k in summary["top_fused_by_time"]]
    assert len(times) == 3 and times == sorted(times, reverse=True)
    assert times[0] == max(k["time_us"] for name, k in data["kernels"].items() if ops_in(name) > 1)
    hits, misses = data["kernel_cache"]["hits"], data["kernel_cache"]["misses"]
    assert summary["caches"]["kernel_cache"]["hit_rate"] == pytest.approx(hits / (hits + misses))
    code, out, _ = cli(capsys, runs["strict"], runs["adaptive"], "--json")
    compared = json.loads(out)
    assert compared["modes"] == ["strict", "adaptive"]
    launches = compared["compared"]["kernels launched"]
    assert launches["ratio"] == pytest.approx(launches["second"] / launches["first"]) and launches["ratio"] < 1


# -- errors: one line, exit status 2 -----------------------------------------------------------
def _bad_files(tmp_path, runs):
    good = json.loads(runs["adaptive"].read_text())
    cases = {
        "missing": (tmp_path / "nope.json", "no such file"),
        "directory": (tmp_path, "is a directory, not a file"),
        "truncated": ("truncated.json", "not a JSON statistics dump ("),
        "binary": ("binary.json", "not UTF-8 text"),
        "list": ("list.json", "top level is not an object"),
        "trace": (runs["strict_trace"], "a NEURON_TRACE timeline, not a NEURON_FUSION_STATS dump"),
        "no version": ("noversion.json", 'no "version" key'),
        "other version": ("v99.json", f"statistics version 99, but this adaptive_eager reads version {STATS_VERSION}"),
        "missing key": ("nokey.json", "missing kernels_launched"),
        "wrong type": ("badtype.json", 'malformed statistics dump ("flushes" is not'),
    }
    contents = {
        "truncated.json": runs["adaptive"].read_text()[:200],
        "binary.json": b"\x89PNG\r\n\x1a\n\xff\xfe",
        "list.json": "[1, 2]",
        "noversion.json": json.dumps({k: v for k, v in good.items() if k != "version"}),
        "v99.json": json.dumps(dict(good, version=99)),
        "nokey.json": json.dumps({k: v for k, v in good.items() if k != "kernels_launched"}),
        "badtype.json": json.dumps(dict(good, flushes=[1, 2])),
    }
    for name, body in contents.items():
        (tmp_path / name).write_bytes(body if isinstance(body, bytes) else body.encode())
    return {case: (path if not isinstance(path, str) else tmp_path / path, message) for case, (path, message) in cases.items()}


@pytest.mark.parametrize("case", ["missing", "directory", "truncated", "binary", "list", "trace", "no version",
                                  "other version", "missing key", "wrong type"])
def test_bad_file_is_one_line_and_exit_2(case, runs, tmp_path, capsys):
    path, message = _bad_files(tmp_path, runs)[case]
    for argv in ([path], [runs["strict"], path], [path, "--json"]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and message in err, err


def test_cli_in_a_fresh_process(runs, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "adaptive_eager.stats", str(runs["strict"]), str(runs["adaptive"])],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "kernels launched" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "adaptive_eager.stats", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path / 'missing.json'}: no such file"]


def test_usage_errors(runs, capsys):
    for argv in ([runs["strict"]] * 3, [runs["strict"], "--top", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in argv])
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err


# -- metrics API ---------------------------------------------------------------------------
def test_metrics_counters_by_name(adaptive_mode):
    x = torch.randn(64, device="neuron")
    (x * 2 + 1).relu().sum().item()
    torch.geqrf(torch.randn(4, 3, device="neuron"))
    stats = adaptive_eager.stats()
    assert adaptive_eager.counter_value("kernels_launched") == stats["kernels_launched"] > 0
    assert adaptive_eager.counter_value("fused_kernels") == stats["fused_kernels"] >= 1
    assert adaptive_eager.counter_value("flushes.host_read") == stats["flushes"]["by_reason"]["host_read"]
    assert adaptive_eager.counter_value("fallback.aten::geqrf") == 1
    assert adaptive_eager.counter_value("no such counter") is None
    names = adaptive_eager.counter_names()
    assert {"ops_recorded", "kernels_launched", "plan_cache.misses", "fallback.aten::geqrf", "sync_points.host_read"} <= set(names)
    assert adaptive_eager.metric_value("device_time_us") == pytest.approx(stats["device_time_us"])
    report = adaptive_eager.metrics_report()
    assert report.splitlines()[0] == "adaptive_eager metrics (mode: adaptive)"
    assert re.search(rf"^Counter: kernels_launched\s+{stats['kernels_launched']}$", report, re.M)
    assert re.search(r"^Counter: fallback\.aten::geqrf\s+1$", report, re.M)
    assert re.search(r"^Metric:\s+device_time_us\s+\d+\.\d{3}$", report, re.M)
    assert "Counter: kernels_skipped" not in report  # zero counters are left out
    adaptive_eager.clear_counters()
    assert adaptive_eager.counter_value("kernels_launched") == 0
    assert adaptive_eager.counter_value("fallback.aten::geqrf") is None
    assert "Counter: (all zero)" in adaptive_eager.metrics_report()


def test_metrics_report_of_a_dump(runs):
    from adaptive_eager.metrics import metrics_report

    data = load(runs["adaptive"])
    report = metrics_report(data)
    assert data["refusals"]
    for reason, count in data["refusals"].items():
        assert re.search(rf"^Counter: refusals\.{re.escape(reason)}\s+{count}$", report, re.M), reason
    assert re.search(rf"^Counter: ops_fused\s+{data['ops_fused']}$", report, re.M)


# -- logging -------------------------------------------------------------------------------
def test_logging_is_silent_by_default_and_debug_explains_refusals(runs, tmp_path):
    assert runs["adaptive_stderr"] == "" and runs["strict_stderr"] == ""  # NEURON_LOG_LEVEL unset
    # the loop rules alone (no on-chip rule): merges are refused for several reasons
    loud = run_loop(tmp_path, "adaptive", {"NEURON_LOG_LEVEL": "debug", "NEURON_ADAPTIVE_ON_CHIP_MB": "0"})
    refusals = json.loads((tmp_path / "adaptive.json").read_text())["refusals"]
    lines = [line for line in loud.stderr.splitlines() if line.startswith("[adaptive_eager.fusion DEBUG] not fusing ")]
    assert loud.stdout == runs["adaptive_stdout"]
    merges = {reason: n for reason, n in refusals.items() if not reason.startswith("pattern:")}
    assert len(merges) >= 2 and len(lines) == sum(merges.values())  # one line per refused merge
    for reason, count in merges.items():
        assert sum(line.endswith(f": {reason}") for line in lines) == count
    # pattern matches refused: one line per reason and planned window, with a count
    logged: dict = {}
    for match in re.finditer(r"^\[adaptive_eager\.fusion DEBUG\] not matching (.+) \((\d+) times\)$", loud.stderr, re.M):
        logged[match.group(1)] = logged.get(match.group(1), 0) + int(match.group(2))
    assert logged == {reason: n for reason, n in refusals.items() if reason.startswith("pattern:")} != {}


def test_application_logging_gets_each_record_once(tmp_path):
    script = "import logging, sys; logging.basicConfig(stream=sys.stderr, format='APP %(name)s %(message)s')\n" + LOOP
    result = run_loop(tmp_path, "adaptive", {"NEURON_LOG_LEVEL": "DEBUG", "NEURON_ADAPTIVE_ON_CHIP_MB": "0"}, script=script)
    app = [line for line in result.stderr.splitlines() if line.startswith("APP adaptive_eager.fusion not fusing")]
    ours = [line for line in result.stderr.splitlines() if line.startswith("[adaptive_eager")]
    assert app and ours == []


def test_a_bad_log_level_is_a_configuration_error(tmp_path):
    """Like every NEURON_* value (tests/device/test_configuration.py): the import works, the
    device's first use names the variable."""
    script = "import adaptive_eager, torch\ntry:\n    torch.ones(1, device='neuron')\nexcept ValueError as e:\n    print(e)"
    result = run_loop(tmp_path, "strict", {"NEURON_LOG_LEVEL": "LOUD"}, script=script)
    assert "NEURON_LOG_LEVEL='LOUD' is not valid: expected DEBUG, INFO, WARNING, ERROR, CRITICAL" in result.stdout


@pytest.fixture
def loop_rules_only():
    from conftest import windows_at_sync_points

    adaptive_eager.enable()
    yield from windows_at_sync_points(on_chip_bytes=0)


def test_set_level_in_process(loop_rules_only, caplog):
    logger = logging.getLogger("adaptive_eager")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert not logging.getLogger("adaptive_eager.fusion").isEnabledFor(logging.DEBUG)
    try:
        logs.set_level("DEBUG")
        assert logging.getLogger("adaptive_eager.fusion").isEnabledFor(logging.DEBUG)
        with caplog.at_level(logging.DEBUG, logger="adaptive_eager"):
            # u feeds an index_select (opaque under the loop rules) and the add after it:
            # merging u with the add would make the kernel both feed and wait on it
            index = torch.tensor(list(range(8)) * 2).to("neuron")
            index.cpu()
            a = torch.randn(8, device="neuron")
            u = a * 2
            both = torch.index_select(u, 0, index)
            (both[:8] + u).cpu()
        refusals = adaptive_eager.stats()["refusals"]
        assert refusals["would create a cycle"] == 1
        messages = [r.getMessage() for r in caplog.records if r.name == "adaptive_eager.fusion"]
        assert len(messages) == sum(refusals.values())
        assert "not fusing aten::mul -> aten::add: would create a cycle" in messages
    finally:
        logs.set_level(None)
    assert logger.level == logging.NOTSET


def test_short_kernel_names_keep_the_head_and_count_the_rest():
    """Labels are cut at the end, at an op boundary, never in the middle (middle-cut names
    of one model's kernels, which share first and last ops, looked alike)."""
    name = "|".join(f"op{i}" for i in range(40))
    label = short_name(name, 40)
    assert len(label) <= 40 and label.startswith("op0|op1|op2|") and " ... " not in label
    shown = label.split("|…")[0].split("|")
    assert label.endswith(f"+{40 - len(shown)} ops")
    assert short_name("mul|add", 40) == "mul|add"


def test_device_time_and_the_kernel_cache_are_explained(runs, capsys, tmp_path):
    """The table says what simulated device time is made of, with the dump's own launch
    overhead (NEURON_SIM_LAUNCH_US), and why the kernel cache hits so rarely."""
    data = load(runs["adaptive"])
    data["device"]["launch_overhead_us"] = 25.0  # another assumed overhead: the note follows the dump
    path = tmp_path / "other_overhead.json"
    path.write_text(json.dumps(data))
    for dump, overhead in ((runs["adaptive"], load(runs["adaptive"])["device"]["launch_overhead_us"]), (path, 25.0)):
        code, out, _ = cli(capsys, dump)
        text = " ".join(out.split())
        launches = data["kernels_launched"]
        share = min(1.0, launches * overhead / data["device_time_us"])
        assert code == 0 and "NEURON_SIM_LAUNCH_US" in text
        assert f"{launches} launches x {overhead:g} us = {launches * overhead / 1000:.3f} ms, {100 * share:.1f}% of it" in text
        assert "a plan-cache hit reuses the plan's kernels and skips it" in text
    code, out, _ = cli(capsys, runs["strict"], runs["adaptive"])
    assert "NEURON_SIM_LAUNCH_US" in out and "skips it" in " ".join(out.split())
