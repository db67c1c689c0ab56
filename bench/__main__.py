"""Adaptive eager against strict eager, compiled mode, CPU eager and Inductor, side by side.

    python -m bench [--quick] [--workloads gpt,decode] [--modes cpu,strict,adaptive,neuron-compiled,compile] [--json]
                    (--modes may also name adaptive-torchneuron: adaptive eager under TorchNeuron's policy)
    python -m bench --wrapper [--runs 3]
    python -m bench --realtime [options of bench/realtime.py]

Every (workload, mode) pair is measured in a fresh process by ``bench/measure.py`` (how
each figure is taken is documented there). Ratios are taken within this one run. Results
go to ``bench/results/latest/<workload>.json`` (``bench/results/`` with ``--save``);
``--quick`` runs fewer steps and skips both ``torch.compile`` modes (Inductor's compile
time alone is minutes on two cores) to stay under three minutes. ``neuron-compiled`` is
the anchor adaptive eager is judged against: the summary gives adaptive / compiled
launches and device time per workload.

``--wrapper`` reads the host cost against its floor: the gpt and llama training steps
and the decode loop (unless ``--workloads`` says otherwise) in ``cpu``, ``wrapper`` (CPU
eager through a thin pass-through ``__torch_dispatch__`` subclass, ``bench/wrapper.py``),
``strict`` and ``adaptive``; the strict and adaptive processes run the wrapper's step
interleaved with their own, and the summary gives wall ms per step and host us per op of
each, and strict / wrapper and adaptive / wrapper. ``--runs N`` repeats every
measurement N times (fresh processes, in turn) and reports each figure's median over
the runs; results go to ``wrapper_<workload>.json``. Every mode runs with one intra-op
thread (``bench/measure.py``), the decode loop included.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import SAVE_HELP, provenance, results_path  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

MODES = ["cpu", "strict", "adaptive", "neuron-compiled", "compile"]
EXTRA_MODES = ["adaptive-torchneuron"]  # on request (--modes): adaptive eager under TorchNeuron's policy
WRAPPER_MODES = ["cpu", "wrapper", "strict", "adaptive"]
WRAPPER_WORKLOADS = ["gpt", "llama", "decode"]
RESULTS = os.path.join(ROOT, "bench", "results")


def run_one(workload: str, mode: str, steps: int, warmup: int, timeout: float, vs_wrapper: bool = False) -> dict:
    command = [sys.executable, "-m", "bench.measure", workload, mode, "--steps", str(steps), "--warmup", str(warmup)]
    if vs_wrapper and mode in ("strict", "adaptive"):
        command.append("--vs-wrapper")
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
    width = max([10] + [len(mode) + 1 for by_mode in results.values() for mode in by_mode])
    header = (
        f"{'workload':<10}{'mode':<{width}}{'launches':>10}{'ops':>8}{'device us':>11}{'MiB moved':>11}"
        f"{'host us/op':>12}{'host us/kern':>14}{'wall ms':>10}{'x cpu':>8}{'x cpu*':>8}{'max |diff|':>12}"
        f"{'peak MiB':>10}"
    )
    lines = [header, "-" * len(header)]
    for workload, by_mode in results.items():
        cpu_wall = by_mode.get("cpu", {}).get("wall_ms_per_step")
        for mode, r in by_mode.items():
            if "error" in r:
                lines.append(f"{workload:<10}{mode:<{width}}  error: {r['error']}")
                continue
            ratio = r["wall_ms_per_step"] / cpu_wall if cpu_wall else None
            moved = r.get("bytes_per_step")
            lines.append(
                f"{workload:<10}{mode:<{width}}{_fmt(r['launches_per_step'], 0):>10}{_fmt(r['ops_per_step'], 0):>8}"
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


def wrapper_summary(results: dict) -> list[str]:
    """Strict and adaptive against the pass-through wrapper, from the interleaved steps."""
    rows = [(w, mode, r) for w, by_mode in results.items() for mode, r in by_mode.items()
            if mode in ("strict", "adaptive") and "wall_vs_wrapper" in r]
    if not rows:
        return []
    header = (f"  {'workload':<10}{'mode':<10}{'wall ms':>9}{'wrapper ms':>12}{'x wrapper':>11}"
              f"{'host us/op':>12}{'wrapper us/op':>15}{'x wrapper':>11}{'wrap-only us/op':>17}")
    lines = ["", "against the pass-through wrapper (its step interleaved in the same process; medians):", header]
    for workload, mode, r in rows:
        lines.append(
            f"  {workload:<10}{mode:<10}{r['wall_ms_per_step']:>9.2f}{r['wrapper_wall_ms_per_step']:>12.2f}"
            f"{r['wall_vs_wrapper']:>11.2f}{r['host_us_per_op']:>12.2f}{r['wrapper_host_us_per_op']:>15.2f}"
            f"{r['host_per_op_vs_wrapper']:>11.2f}{r['wrapper_overhead_us_per_op']:>17.2f}"
        )
    lines.append("  x wrapper: median of per-step ratios. The wrapper runs its CPU kernels on the host thread, so its "
                 "host us/op holds their compute; wrap-only us/op is its host time less CPU eager's, per op")
    return lines


def median_result(runs: list[dict]) -> dict:
    """One measurement from several runs of it: each number's median (the deterministic
    figures are the same in every run), the rest from the first run; any error wins."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(r[key] for r in runs)
    if len(runs) > 1:
        merged["runs"] = len(runs)
    return merged


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--realtime" in argv:  # the wall clock against CPU eager with Hugging Face models: bench/realtime.py
        from bench import realtime

        return realtime.main([a for a in argv if a != "--realtime"])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no torch.compile (< 3 minutes)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("--wrapper", action="store_true",
                        help="host cost against a pass-through __torch_dispatch__ wrapper: gpt, llama, decode in "
                             "cpu, wrapper, strict, adaptive (strict/adaptive interleave the wrapper's step)")
    parser.add_argument("--runs", type=int, default=1, help="measure each workload and mode N times; report medians")
    parser.add_argument("--realtime", action="store_true",
                        help="the wall clock against CPU eager with Hugging Face models: bench/realtime.py, which takes "
                             "the other options (python -m bench --realtime --help)")
    args = parser.parse_args(argv)
    if args.wrapper:
        args.workloads = args.workloads if args.workloads != ",".join(WORKLOADS) else ",".join(WRAPPER_WORKLOADS)
        args.modes = args.modes or ",".join(WRAPPER_MODES)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads: {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    modes = args.modes.split(",") if args.modes else (MODES[:3] if args.quick else MODES)
    unknown = [m for m in modes if m not in MODES + WRAPPER_MODES + EXTRA_MODES]
    if unknown:
        parser.error(f"unknown modes: {', '.join(unknown)} "
                     f"(known: {', '.join(dict.fromkeys(MODES + WRAPPER_MODES + EXTRA_MODES))})")
    vs_wrapper = "wrapper" in modes
    results: dict = {}
    started = time.perf_counter()
    total = len(workloads) * len(modes) * args.runs
    done = 0
    for workload in workloads:
        spec = WORKLOADS[workload]
        steps = args.steps or (spec.quick_steps if args.quick else spec.steps)
        runs: dict = {mode: [] for mode in modes}
        for _ in range(args.runs):  # the modes in turn, so a slow spell of the machine hits them alike
            for mode in modes:
                done += 1
                print(f"[{done}/{total}] {workload} / {mode} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
                timeout = 1800 if "compile" in mode else 600
                runs[mode].append(run_one(workload, mode, steps, 2, timeout, vs_wrapper))
        results[workload] = {mode: median_result(runs[mode]) for mode in modes}
        name = f"wrapper_{workload}.json" if vs_wrapper else f"{workload}.json"  # never over the main table's
        with open(results_path(name, args.save), "w") as handle:
            json.dump({"workload": workload, "description": spec.description, "taken": provenance(),
                       "results": results[workload]}, handle, indent=2)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("\n".join(summarize(results) + wrapper_summary(results)))
        print(f"\n({time.perf_counter() - started:.0f} s; results in {os.path.dirname(results_path('x', args.save))}/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
