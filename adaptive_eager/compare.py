"""``python -m adaptive_eager.compare [options] script.py [args ...]``: run a script in strict eager and
in adaptive eager under both policies, ours and TorchNeuron's (``adaptive_eager/policies.py``),
and print what the device did side by side: launches, bytes, simulated device time, the
top kernels.

Each run is a fresh process (``NEURON_ADAPTIVE_EAGER``, ``NEURON_ADAPTIVE_POLICY``,
``NEURON_FUSION_STATS`` set; everything else inherited), so the script needs no change.
The script's own output is compared too: the three runs must print the same thing (both
policies run the same kernels in program order; only the grouping differs), and the
command says whether they did. Options go before the script; what follows it is the
script's.

    --html report.html   also write the HTML report of the three runs
    --json               print the figures as JSON instead
    --top N              kernels listed per run (default 5)
    --keep DIR           keep the three statistics dumps (strict.json, ours.json,
                         torchneuron.json) in DIR

Exit status: 0, or 1 if a run failed or the runs printed different output, 2 for a bad
argument.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from .report_text import StatsFileError, format_runs, kernel_rows, launch_share, load

# (name, environment): the three runs, in the order they are shown
RUNS = (
    ("strict", {"NEURON_ADAPTIVE_EAGER": "0"}),
    ("ours", {"NEURON_ADAPTIVE_EAGER": "1", "NEURON_ADAPTIVE_POLICY": "ours"}),
    ("torchneuron", {"NEURON_ADAPTIVE_EAGER": "1", "NEURON_ADAPTIVE_POLICY": "torchneuron"}),
)


def run_script(script: str, args: list, folder: str, timeout: float | None = None) -> dict:
    """Run ``script`` once per entry of :data:`RUNS`; returns {name: {"stats": path,
    "returncode", "stdout", "stderr"}}."""
    results = {}
    for name, env in RUNS:
        path = os.path.join(folder, f"{name}.json")
        environ = dict(os.environ, **env, NEURON_FUSION_STATS=path)
        done = subprocess.run([sys.executable, script, *args], env=environ, capture_output=True, text=True,
                              timeout=timeout)
        results[name] = {"stats": path, "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    return results


def figures(dumps: dict, top: int) -> dict:
    """The side-by-side figures as plain data (what ``--json`` prints)."""
    out = {}
    for name, data in dumps.items():
        out[name] = {
            "mode": data["mode"], "policy": data.get("policy"), "ops_recorded": data["ops_recorded"],
            "kernels_launched": data["kernels_launched"], "fused_kernels": data["fused_kernels"],
            "bytes_moved": data["bytes_moved"], "device_time_us": data["device_time_us"],
            "launch_share": launch_share(data),
            "top_kernels": [{k: row[k] for k in ("name", "ops", "launches", "time_us", "bytes")}
                            for row in sorted(kernel_rows(data, True) + kernel_rows(data, False),
                                              key=lambda r: (-r["time_us"], -r["launches"], r["name"]))[:top]],
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m adaptive_eager.compare",
        description="Run a script in strict eager and in adaptive eager under our policy and TorchNeuron's; "
                    "print launches, bytes, simulated device time and the top kernels side by side.")
    parser.add_argument("script", help="the Python script to run (unchanged)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    parser.add_argument("--html", metavar="report.html", help="also write the HTML report of the three runs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--top", type=int, default=5, help="kernels listed per run (default 5)")
    parser.add_argument("--keep", metavar="DIR", help="keep the statistics dumps in DIR")
    options = parser.parse_args(argv)
    if not os.path.isfile(options.script):
        parser.error(f"{options.script}: no such file")
    if options.top < 1:
        parser.error("--top must be at least 1")
    with tempfile.TemporaryDirectory() as scratch:
        folder = options.keep or scratch
        os.makedirs(folder, exist_ok=True)
        runs = run_script(options.script, options.args, folder)
        failed = [name for name, run in runs.items() if run["returncode"] != 0]
        for name in failed:
            tail = runs[name]["stderr"].strip().splitlines()[-5:]
            print(f"error: the {name} run exited with status {runs[name]['returncode']}:", *tail, sep="\n  ",
                  file=sys.stderr)
        if failed:
            return 1
        try:
            dumps = {name: load(run["stats"]) for name, run in runs.items()}
        except StatsFileError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        same_output = len({run["stdout"] for run in runs.values()}) == 1
        if options.json:
            print(json.dumps({"script": options.script, "same_output": same_output,
                              "runs": figures(dumps, options.top)}, indent=2, sort_keys=True))
        else:
            print(format_runs(list(dumps.values()), ["strict", "adaptive, ours", "adaptive, torchneuron"], options.top))
            print()
            print("script output: " + ("identical in the three runs" if same_output else
                                       "DIFFERS between runs (each run's stdout is kept with --keep DIR)"))
            if options.keep:
                for name, run in runs.items():
                    with open(os.path.join(folder, f"{name}.stdout"), "w", encoding="utf-8") as handle:
                        handle.write(run["stdout"])
        if options.html:
            from .report import render

            page = render(list(dumps.values()), [f"{name}.json" for name in dumps])
            with open(options.html, "w", encoding="utf-8") as handle:
                handle.write(page)
            print(f"wrote {options.html}")
    return 0 if same_output else 1


def _main() -> int:
    try:
        return main()
    except BrokenPipeError:  # `... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(_main())
