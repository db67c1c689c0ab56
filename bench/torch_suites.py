"""PyTorch's upstream device-generic test files on ``neuron`` (strict and adaptive eager),
and the same files on the CPU, for a pass-rate comparison on the same tests.

The files are not part of this repository: give the path of a PyTorch ``test/`` folder.
The results in ``bench/results/torch_suites.json`` and the README come from the
``test/`` folder of the snapshot ``yakov-helm/pytorch_exp`` at c5e2a77 (2023-04-13,
version.txt ``2.1.0a0``): the newest whole PyTorch tree the ``fetch`` tool could bring
here (``pytorch/pytorch`` itself, and every newer fork tried, are over its 500 MB size
limit). Extracted with::

    git --git-dir=<fetched git dir> archive HEAD test | tar -x -C /tmp/pytorch_tests

The names those files import that torch 2.13 dropped are restored by
:mod:`bench.torch_suites_shim` (the pytest plugin each process loads; it also keeps
only the classes instantiated for the device under test and logs every test).

For each run (``strict``, ``adaptive``: ``neuron`` with ``NEURON_ADAPTIVE_EAGER`` 0 or
1; ``cpu``) and each file, one pytest process runs the file with
``PYTORCH_TESTING_DEVICE_ONLY_FOR=<device>``, pytest-timeout's per-test limit and a
wall-clock limit per process. A process that dies (segfault, abort, the wall-clock
limit) is started again without the tests that finished; the test it died in is counted
as a ``crash`` (its message says how the process ended).

Usage::

    python bench/torch_suites.py /tmp/pytorch_tests/test [--files test_view_ops.py,...]
        [--runs strict,adaptive,cpu] [--timeout 120] [--process-timeout 2400] [--save]

Prints a per-class table per run (run, pass, fail, error, skip, crash, and TorchNeuron's
published expected-failure count), the overall pass rates, and the failures grouped by
message; writes ``bench/results/latest/torch_suites.json`` (``--save``:
``bench/results/torch_suites.json``). Results of earlier invocations in that JSON are
kept for (run, file) pairs this invocation does not run, so files can be run a few at a
time.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
if ROOT not in sys.path:  # `python bench/torch_suites.py`
    sys.path.insert(0, ROOT)
from bench import SAVE_HELP, provenance, results_path  # noqa: E402

# The files the issue lists, in priority order (TestNNDeviceType lives in test_nn.py;
# TestScatterGather in test_scatter_gather_ops.py in this version).
DEFAULT_FILES = (
    "test_view_ops.py", "test_scatter_gather_ops.py", "test_tensor_creation_ops.py", "test_nn.py",
    "test_indexing.py", "test_type_promotion.py", "test_sort_and_select.py", "test_torch.py",
    "nn/test_embedding.py", "nn/test_convolution.py",
)
RUNS = {  # run -> (device, environment)
    "strict": ("neuron", {"NEURON_ADAPTIVE_EAGER": "0"}),
    "adaptive": ("neuron", {"NEURON_ADAPTIVE_EAGER": "1"}),
    "cpu": ("cpu", {}),
}
# TorchNeuron's expected-failure lists at its public beta (the table).
TORCHNEURON_XFAILS = {"TestNNDeviceType": 495, "TestTensorCreation": 115, "TestViewOps": 46,
                      "TestScatterGather": 40}
TEST_TIMEOUT_S = 120
PROCESS_TIMEOUT_S = 2400
MAX_RESTARTS = 100
OUTCOMES = ("pass", "fail", "error", "skip", "xfail", "crash")


# -- one file ----------------------------------------------------------------------------
def _read_log(path: str) -> list:
    records = []
    if os.path.exists(path):
        with open(path) as handle:
            for line in handle:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by the crash
    return records


def outcomes_from_log(records: list) -> tuple:
    """(results, running): ``{nodeid: (outcome, message)}`` of the tests that finished,
    and the node id of the test that started but never finished (or None)."""
    results, started = {}, None
    for record in records:
        if "start" in record:
            started = record["start"]
        elif "finish" in record:
            started = None
            results.setdefault(record["finish"], ("pass", ""))
        else:
            nodeid, outcome = record["nodeid"], record["outcome"]
            if outcome == "skipped":
                new = ("xfail" if record.get("xfail") else "skip", record["message"])
            elif outcome == "failed":
                new = ("fail" if record["when"] == "call" else "error", record["message"])
            else:
                new = ("pass", "")
            previous = results.get(nodeid)
            if previous is None or previous[0] == "pass" or new[0] == "error":
                results[nodeid] = new  # a failing teardown after a pass is an error
    return results, started


def _wait(proc, log: str, limit: int, stall: int) -> tuple:
    """(returncode, why it was killed or ""): wait for ``proc``; kill its process group
    after ``limit`` s, or when ``log`` has not grown for ``stall`` s (a test hung where
    pytest-timeout's signal cannot reach it, e.g. inside a kernel)."""
    began = last = time.monotonic()
    size = -1
    while True:
        try:
            return proc.wait(timeout=2), ""
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        current = os.path.getsize(log) if os.path.exists(log) else 0
        if current != size:
            size, last = current, now
        why = (f"the {limit} s wall-clock limit per process" if now - began > limit
               else f"no test finished for {stall} s" if now - last > stall else "")
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), why


def _ending(returncode, timed_out: str, seconds: int) -> str:
    if timed_out:
        return f"process killed: {timed_out} (hang)"
    if returncode < 0:
        return f"process died: {signal.Signals(-returncode).name}"
    return f"process exited with status {returncode} mid-test"


def run_file(test_dir: str, relpath: str, run: str, work: str, test_timeout: int,
             process_timeout: int, echo=print) -> dict:
    """Run one file for one run until it completes; returns its record."""
    device, extra_env = RUNS[run]
    stem = f"{run}-{relpath.replace('/', '_')}"
    log, done = os.path.join(work, stem + ".jsonl"), os.path.join(work, stem + ".done")
    for path in (log, done):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, PYTORCH_TESTING_DEVICE_ONLY_FOR=device, TORCH_SUITES_DEVICE=device,
               TORCH_SUITES_SUFFIX=device.upper(), TORCH_SUITES_LOG=log, TORCH_SUITES_DONE=done,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               **extra_env)
    command = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-p", "bench.torch_suites_shim",
               "--noconftest", "-p", "no:cacheprovider", "-q", "-p", "no:warnings",
               f"--timeout={test_timeout}", "--timeout-method=signal", relpath]
    crashes, processes, began = {}, 0, time.perf_counter()
    status = "complete"
    while True:
        processes += 1
        with open(os.path.join(work, stem + ".out"), "a") as out:
            proc = subprocess.Popen(command, cwd=test_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            returncode, timed_out = _wait(proc, log, process_timeout, 2 * test_timeout + 60)
        results, running = outcomes_from_log(_read_log(log))
        if running is None or returncode in (0, 1, 5) and not timed_out:
            if returncode not in (0, 1, 5):
                status = f"process ended with status {returncode} between tests"
            break
        crashes[running] = _ending(returncode, timed_out, process_timeout)
        echo(f"    crash in {running}: {crashes[running]}; resuming")
        with open(done, "w") as handle:
            handle.write("\n".join(list(results) + list(crashes)) + "\n")
        if processes > MAX_RESTARTS:
            status = f"stopped after {MAX_RESTARTS} restarts"
            break
    for nodeid, message in crashes.items():
        results[nodeid] = ("crash", message)
    return {"status": status, "processes": processes, "seconds": round(time.perf_counter() - began, 1),
            "tests": {nodeid: list(value) for nodeid, value in sorted(results.items())}}


# -- tables -------------------------------------------------------------------------------
def class_of(nodeid: str, device: str) -> str:
    """``TestViewOps`` of ``test_view_ops.py::TestViewOpsNEURON::test_x_neuron``."""
    parts = nodeid.split("::")
    name = parts[1] if len(parts) > 2 else parts[0]
    suffix = device.upper()
    return name[: -len(suffix)] if name.endswith(suffix) else name


def class_counts(files: dict, device: str) -> dict:
    """``{class: {outcome: n, "run": n}}`` over the files of one run."""
    table = collections.defaultdict(collections.Counter)
    for record in files.values():
        for nodeid, (outcome, _) in record["tests"].items():
            counts = table[class_of(nodeid, device)]
            counts[outcome] += 1
            counts["run"] += 1
    return {name: dict(counts) for name, counts in sorted(table.items())}


def totals(classes: dict) -> dict:
    total = collections.Counter()
    for counts in classes.values():
        total.update(counts)
    ran = total["run"] - total["skip"] - total["xfail"]
    total = dict(total)
    total["pass_pct"] = round(100.0 * total.get("pass", 0) / ran, 1) if ran else 0.0
    return total


def format_table(name: str, classes: dict) -> list:
    lines = [f"== {name}", f"  {'class':40s} {'run':>5s} {'pass':>5s} {'fail':>5s} {'error':>5s} {'skip':>5s} "
                           f"{'xfail':>5s} {'crash':>5s} {'TorchNeuron xfail':>18s}"]
    for cls, counts in list(classes.items()) + [("total", totals(classes))]:
        theirs = TORCHNEURON_XFAILS.get(cls, "")
        lines.append(f"  {cls:40s} {counts.get('run', 0):5d} " + " ".join(
            f"{counts.get(o, 0):5d}" for o in OUTCOMES) + f" {theirs!s:>18s}")
    total = totals(classes)
    lines.append(f"  pass rate (pass / (run - skip - xfail)): {total['pass_pct']:.1f}%")
    return lines


def _one_line(message: str) -> str:
    return " ".join(message.split())


def group_key(message: str) -> str:
    text = re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?(e[-+]?\d+)?", "#", message)
    return text[:150]


def failure_groups(files: dict, top: int = 25) -> list:
    """(count, message pattern, example nodeid, example message) of the failures, errors
    and crashes, most frequent first."""
    groups = collections.defaultdict(list)
    for record in files.values():
        for nodeid, (outcome, message) in record["tests"].items():
            if outcome in ("fail", "error", "crash"):
                groups[(outcome, group_key(message))].append((nodeid, message))
    ordered = sorted(groups.items(), key=lambda item: (item[0][0] != "crash", -len(item[1])))
    return [(len(members), outcome, members[0][0], members[0][1][:300])
            for (outcome, _), members in ordered[:top]]


# -- results file -------------------------------------------------------------------------
def source_info(test_dir: str) -> dict:
    """The test files' version: ``../version.txt`` and ``../SOURCE`` beside the folder."""
    info = {"path": os.path.abspath(test_dir)}
    for name, key in (("version.txt", "version"), ("SOURCE", "source")):
        path = os.path.join(test_dir, os.pardir, name)
        if os.path.exists(path):
            with open(path) as handle:
                info[key] = handle.read().strip()
    return info


def load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as handle:
            return json.load(handle)
    return {}


def summarize(result: dict) -> None:
    runs = result.setdefault("runs", {})
    result["classes"] = {run: class_counts(files, RUNS[run][0]) for run, files in runs.items()}
    result["totals"] = {run: totals(classes) for run, classes in result["classes"].items()}
    result["files_run"] = {run: sorted(files) for run, files in runs.items()}


def report(result: dict) -> str:
    lines = [f"PyTorch device-generic test files: {result['source'].get('source', '?')} "
             f"(version {result['source'].get('version', '?')}), torch {result['torch']}", ""]
    for run, classes in result["classes"].items():
        lines += format_table(f"{run}: files {', '.join(result['files_run'][run])}", classes) + [""]
        for count, outcome, nodeid, message in failure_groups(result["runs"][run]):
            lines.append(f"  [{count} {outcome}] {nodeid}: {_one_line(message)[:200]}")
        lines.append("")
    return "\n".join(lines)


def markdown(result: dict, classes=None) -> str:
    """The README's table: per class, each run's counts side by side, TorchNeuron's list;
    over the files that every run has finished (so the pass rates are on the same files)."""
    runs = list(result["runs"])
    common = set.intersection(*(set(files) for files in result["runs"].values()))
    by_run = {r: class_counts({f: rec for f, rec in result["runs"][r].items() if f in common}, RUNS[r][0])
              for r in runs}
    result = dict(result, classes=by_run, totals={r: totals(c) for r, c in by_run.items()})
    names = classes or sorted({c for per in by_run.values() for c in per})
    head = "| class | " + " | ".join(f"{r}: run / pass / fail / error / skip / crash" for r in runs)
    lines = [head + " | TorchNeuron xfail |", "| --- |" + " ---: |" * (len(runs) + 1)]

    def cell(counts):
        return " / ".join(str(counts.get(k, 0)) for k in ("run", "pass", "fail", "error")) + \
            f" / {counts.get('skip', 0) + counts.get('xfail', 0)} / {counts.get('crash', 0)}"
    for name in names:
        lines.append(f"| {name} | " + " | ".join(cell(result["classes"][r].get(name, {})) for r in runs)
                     + f" | {TORCHNEURON_XFAILS.get(name, '')} |")
    lines.append("| **total** | " + " | ".join(cell(result["totals"][r]) for r in runs) + " | |")
    lines.append("| pass % of run - skip | " + " | ".join(f"{result['totals'][r]['pass_pct']:.1f}" for r in runs) + " | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_dir", nargs="?", help="a PyTorch test/ folder")
    parser.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated, relative to test_dir")
    parser.add_argument("--runs", default="strict,adaptive,cpu", help="strict, adaptive, cpu (default all)")
    parser.add_argument("--timeout", type=int, default=TEST_TIMEOUT_S, help="seconds per test (pytest-timeout)")
    parser.add_argument("--process-timeout", type=int, default=PROCESS_TIMEOUT_S,
                        help="wall-clock seconds per pytest process before it is killed and resumed")
    parser.add_argument("--json", default=None, help="results file (default: see --save)")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("--work", default=None, help="folder for the per-process logs (default: a temporary one)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the per-class table of the results file as markdown and exit (runs nothing)")
    options = parser.parse_args(argv)
    if options.markdown:
        result = load(options.json or results_path("torch_suites.json", options.save))
        print(markdown(result))
        return 0
    if not options.test_dir:
        parser.error("the test_dir argument is required (a PyTorch test/ folder)")
    runs = [r.strip() for r in options.runs.split(",") if r.strip()]
    for run in runs:
        if run not in RUNS:
            parser.error(f"unknown run {run!r} (one of {', '.join(RUNS)})")
    files = [f.strip() for f in options.files.split(",") if f.strip()]
    for relpath in files:
        if not os.path.exists(os.path.join(options.test_dir, relpath)):
            parser.error(f"no {relpath} in {options.test_dir}")
    path = options.json or results_path("torch_suites.json", options.save)
    result = load(path)
    result.update(source=source_info(options.test_dir), torch=__import__("torch").__version__,
                  taken=provenance(), test_timeout_s=options.timeout)
    work = options.work or tempfile.mkdtemp(prefix="torch_suites_")
    os.makedirs(work, exist_ok=True)
    for relpath in files:
        for run in runs:
            print(f"{run} {relpath} ...", flush=True)
            record = run_file(options.test_dir, relpath, run, work, options.timeout, options.process_timeout)
            record["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            result.setdefault("runs", {}).setdefault(run, {})[relpath] = record
            counts = collections.Counter(outcome for outcome, _ in record["tests"].values())
            print(f"  {record['seconds']} s, {record['processes']} process(es): {dict(counts)}", flush=True)
            summarize(result)
            _write(result, path)
    summarize(result)
    print(report(result))
    _write(result, path)
    print(f"wrote {os.path.relpath(path)} (per-process logs in {work})")
    return 0


def _write(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=False)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
