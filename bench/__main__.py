"""Adaptive eager against strict eager, compiled mode, CPU eager and Inductor, side by side.

    python -m bench [--quick] [--workloads gpt,decode] [--modes cpu,strict,adaptive,neuron-compiled,compile] [--json]

Every (workload, mode) pair is measured in a fresh process by ``bench/measure.py`` (how
each figure is taken is documented there). Ratios are taken within this one run. Results
go to ``bench/results/latest/<workload>.json`` (``bench/results/`` with ``--save``);
``--quick`` runs fewer steps and skips both ``torch.compile`` modes (Inductor's compile
time alone is minutes on two cores) to stay under three minutes. ``neuron-compiled`` is
the anchor adaptive eager is judged against: the summary gives adaptive / compiled
launches and device time per workload.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import SAVE_HELP, provenance, results_path  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

MODES = ["cpu", "strict", "adaptive", "neuron-compiled", "compile"]
RESULTS = os.path.join(ROOT, "bench", "results")


def run_one(workload: str, mode: str, steps: int, warmup: int, timeout: float) -> dict:
    command = [sys.executable, "-m", "bench.measure", workload, mode, "--steps", str(steps), "--warmup", str(warmup)]
    env = dict(os.environ, NEURON_ADAPTIVE_EAGER="0")
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"workload": workload, "mode": mode, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"workload": workload, "mode": mode, "error": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def summarize(results: dict) -> list[str]:
    header = (
        f"{'workload':<10}{'mode':<10}{'launches':>10}{'ops':>8}{'device us':>11}{'MiB moved':>11}"
        f"{'host us/op':>12}{'host us/kern':>14}{'wall ms':>10}{'x cpu':>8}{'x cpu*':>8}{'max |diff|':>12}"
        f"{'peak MiB':>10}"
    )
    lines = [header, "-" * len(header)]
    for workload, by_mode in results.items():
        cpu_wall = by_mode.get("cpu", {}).get("wall_ms_per_step")
        for mode, r in by_mode.items():
            if "error" in r:
                lines.append(f"{workload:<10}{mode:<10}  error: {r['error']}")
                continue
            ratio = r["wall_ms_per_step"] / cpu_wall if cpu_wall else None
            moved = r.get("bytes_per_step")
            lines.append(
                f"{workload:<10}{mode:<10}{_fmt(r['launches_per_step'], 0):>10}{_fmt(r['ops_per_step'], 0):>8}"
                f"{_fmt(r.get('device_time_us_per_step'), 0):>11}{_fmt(moved / (1 << 20) if moved else None, 2):>11}"
                f"{_fmt(r['host_us_per_op'], 2):>12}{_fmt(r.get('host_us_per_kernel'), 1):>14}"
                f"{_fmt(r['wall_ms_per_step'], 2):>10}{_fmt(ratio, 2):>8}{_fmt(r.get('wall_vs_cpu_eager'), 2):>8}"
                f"{r['max_abs_diff']:>12.2e}{r['peak_memory_bytes'] / (1 << 20):>10.1f}"
            )
    lines.append("")
    lines.append("host us/kern: host CPU time per step / kernels launched per step (the device worker's excluded); "
                 "x cpu*: median wall ratio to CPU eager steps interleaved in the same process")
    for mode, label in (("neuron-compiled", "neuron backend"), ("compile", "Inductor")):
        compiled = {w: m[mode].get("compile_seconds") for w, m in results.items() if mode in m}
        if any(compiled.values()):
            lines.append("")
            lines.append(f"torch.compile ({label}) compile time (excluded above): "
                         + ", ".join(f"{w} {s:.1f} s" for w, s in compiled.items() if s))
    lines.append("")
    lines.append("adaptive vs strict (same run):")
    for workload, by_mode in results.items():
        strict, adaptive = by_mode.get("strict"), by_mode.get("adaptive")
        if not strict or not adaptive or "error" in strict or "error" in adaptive:
            continue
        text = (
            f"  {workload:<10} launches {adaptive['launches_per_step'] / strict['launches_per_step']:.2f}x, "
            f"device time {strict['device_time_us_per_step'] / adaptive['device_time_us_per_step']:.2f}x lower, "
            f"bytes {adaptive['bytes_per_step'] / strict['bytes_per_step']:.2f}x, "
            f"host us/op {adaptive['host_us_per_op'] / strict['host_us_per_op']:.2f}x, "
            f"wall {adaptive['wall_ms_per_step'] / strict['wall_ms_per_step']:.2f}x"
        )
        inductor = by_mode.get("compile")
        if inductor and "error" not in inductor:
            text += f"; Inductor launches {inductor['launches_per_step']:.0f} vs adaptive {adaptive['launches_per_step']:.0f}"
        lines.append(text)
    anchored = [(w, m["adaptive"], m["neuron-compiled"]) for w, m in results.items()
                if "error" not in m.get("adaptive", {"error": 1}) and "error" not in m.get("neuron-compiled", {"error": 1})]
    if anchored:
        lines.append("")
        lines.append("adaptive / compiled (the anchor; same run, same cost model):")
        for workload, adaptive, compiled in anchored:
            lines.append(
                f"  {workload:<10} launches {adaptive['launches_per_step'] / compiled['launches_per_step']:.2f}x, "
                f"device time {adaptive['device_time_us_per_step'] / compiled['device_time_us_per_step']:.2f}x, "
                f"bytes {adaptive['bytes_per_step'] / compiled['bytes_per_step']:.2f}x, "
                f"wall {adaptive['wall_ms_per_step'] / compiled['wall_ms_per_step']:.2f}x"
            )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no torch.compile (< 3 minutes)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads: {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    modes = args.modes.split(",") if args.modes else (MODES[:3] if args.quick else MODES)
    results: dict = {}
    started = time.perf_counter()
    total = len(workloads) * len(modes)
    done = 0
    for workload in workloads:
        spec = WORKLOADS[workload]
        steps = args.steps or (spec.quick_steps if args.quick else spec.steps)
        results[workload] = {}
        for mode in modes:
            done += 1
            print(f"[{done}/{total}] {workload} / {mode} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            timeout = 1800 if "compile" in mode else 600
            results[workload][mode] = run_one(workload, mode, steps, 2, timeout)
        with open(results_path(f"{workload}.json", args.save), "w") as handle:
            json.dump({"workload": workload, "description": spec.description, "taken": provenance(),
                       "results": results[workload]}, handle, indent=2)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("\n".join(summarize(results)))
        print(f"\n({time.perf_counter() - started:.0f} s; results in {os.path.dirname(results_path('x', args.save))}/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
