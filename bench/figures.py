"""Regenerate the README's screenshot of the fusion report, docs/report.png.

    python -m bench.figures [--steps 20]

Runs the README's "Seeing what happened" commands in a scratch folder (the demo in strict
and in adaptive eager with statistics and traces, then the report), screenshots the page
in headless Chromium (Debian's ``chromium``), and records when, at which commit and on
what machine in ``docs/figures.json``, which the README's caption quotes. Exit status 2
when Chromium is missing. The README's op-coverage and Hugging Face tables come from
``python bench/op_coverage.py --save`` and ``python bench/hf_models.py --save`` (their
JSON in bench/results/ records the same provenance under "taken").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench import describe, provenance  # noqa: E402

PNG = os.path.join(ROOT, "docs", "report.png")
RECORD = os.path.join(ROOT, "docs", "figures.json")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars")


def _run(command, cwd, env=None, quiet=False):
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL if quiet else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="demo steps per mode (the README's 20)")
    parser.add_argument("--height", type=int, default=3300, help="screenshot height in pixels")
    args = parser.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("error: no chromium on PATH (Debian: apt-get install chromium); docs/report.png not regenerated",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        base = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
        for mode in ("strict", "adaptive"):
            env = dict(base, NEURON_FUSION_STATS=f"{mode}.json", NEURON_TRACE=f"{mode}_trace.json")
            _run([sys.executable, "-m", "adaptive_eager.demo", "--mode", mode, "--steps", str(args.steps)], scratch, env)
        _run([sys.executable, "-m", "adaptive_eager.report", "strict.json", "adaptive.json", "--trace", "strict_trace.json",
              "--trace", "adaptive_trace.json", "-o", "report.html"], scratch, base)
        adaptive = json.load(open(os.path.join(scratch, "adaptive.json")))
        strict = json.load(open(os.path.join(scratch, "strict.json")))
        _run([browser, *FLAGS, f"--user-data-dir={os.path.join(scratch, 'profile')}", f"--screenshot={PNG}",
              f"--window-size=1280,{args.height}", "file://" + os.path.join(scratch, "report.html")], scratch, quiet=True)  # its D-Bus noise
    taken = provenance()
    record = {"docs/report.png": {
        "command": f"python -m bench.figures --steps {args.steps}",
        "taken": taken,
        "figures": {mode: {"ops_recorded": d["ops_recorded"], "kernels_launched": d["kernels_launched"]}
                    for mode, d in (("strict", strict), ("adaptive", adaptive))},
    }}
    with open(RECORD, "w") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
    print(f"wrote {os.path.relpath(PNG)} and {os.path.relpath(RECORD)}: {describe(taken)}")
    print(f"strict {strict['ops_recorded']:,} ops / {strict['kernels_launched']:,} launches; "
          f"adaptive {adaptive['kernels_launched']:,} launches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
