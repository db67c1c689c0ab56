"""Host overhead per op, in one run: CPU eager, the thinnest possible Python device (a
pass-through ``__torch_dispatch__`` wrapper), and ``neuron`` in strict and adaptive mode.

    python bench/overhead.py [--ops 1000] [--repeats 21] [--json]

For each mode, the same chain of small elementwise ops (a 64-element tensor, so kernel
time is negligible and the host's per-op cost dominates) is issued ``--ops`` times, then
synchronized, like one training step. The wrapper is ``bench/wrapper.py``'s, which
``python -m bench --wrapper`` runs whole workloads through. ``neuron`` reports two
figures: host (time to issue the ops; the device worker runs concurrently when the host
rings its doorbell) and host+device (until the synchronize returns). Each figure is the
median of ``--repeats`` steps; ratios are taken within this run, never across runs.
Results go to ``bench/results/latest/overhead.json`` (``bench/results/overhead.json`` with ``--save``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import adaptive_eager  # noqa: E402
from bench import SAVE_HELP, provenance, results_path  # noqa: E402
from adaptive_eager_device.hardware.sink import synchronize  # noqa: E402
from bench.wrapper import PassThrough  # noqa: E402

OPS_PER_CHAIN = 5


def chain(x, scale):
    y = x * scale
    y = y + x
    y = torch.relu(y)
    y = y - 0.5
    return y.neg()


def _time(run, ops: int, repeats: int, finish=lambda: None):
    samples = []
    for _ in range(repeats):
        finish()
        started = time.perf_counter()
        run(ops // OPS_PER_CHAIN)
        issued = time.perf_counter()
        finish()
        done = time.perf_counter()
        samples.append(((issued - started) / ops * 1e6, (done - started) / ops * 1e6))
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def measure(ops: int, repeats: int) -> dict:
    base = torch.randn(64)

    def loop_on(x):
        def run(chains):
            for _ in range(chains):
                chain(x, 1.5)

        return run

    results = {}
    cpu_host, _ = _time(loop_on(base), ops, repeats)
    results["cpu_eager"] = {"host_us_per_op": cpu_host}
    wrapped = PassThrough(base)
    wrapper_host, _ = _time(loop_on(wrapped), ops, repeats)
    results["passthrough_wrapper"] = {"host_us_per_op": wrapper_host}
    device_x = base.to("neuron")
    for mode in ("strict", "adaptive"):
        if mode == "adaptive" and not hasattr(adaptive_eager, "enable"):
            continue
        context = adaptive_eager.mode(mode == "adaptive") if hasattr(adaptive_eager, "mode") else _null()
        with context:
            chain(device_x, 1.5)  # warm the caches
            synchronize()
            host, total = _time(loop_on(device_x), ops, repeats, finish=synchronize)
        results[f"neuron_{mode}"] = {"host_us_per_op": host, "host_and_device_us_per_op": total}
    for name, value in results.items():
        value["ratio_to_passthrough"] = value["host_us_per_op"] / wrapper_host
    return results


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1000, help="ops per step (then a sync)")
    parser.add_argument("--repeats", type=int, default=21, help="steps; the median is reported")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.ops, args.repeats)
    with open(results_path("overhead.json", args.save), "w") as handle:
        json.dump(dict(results, taken=provenance()), handle, indent=2)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"host overhead per op (steps of {args.ops} small elementwise ops, median of {args.repeats} steps)")
    print(f"{'mode':<22}{'host us/op':>12}{'host+device us/op':>20}{'host / passthrough':>20}")
    for name, value in results.items():
        total = value.get("host_and_device_us_per_op")
        total_text = f"{total:.2f}" if total is not None else "-"
        print(f"{name:<22}{value['host_us_per_op']:>12.2f}{total_text:>20}{value['ratio_to_passthrough']:>20.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
