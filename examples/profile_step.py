"""Profile one training step on ``neuron`` with ``torch.profiler``, as on a GPU.

    python examples/profile_step.py [--mode strict|adaptive|compiled] [--trace profile_trace.json]

Trains a small model for two warm-up steps, profiles the third with
``activities=[CPU, PrivateUse1]`` (``record_shapes``, ``profile_memory``), prints
``key_averages()`` sorted by device time (the NEURON columns), writes the Chrome trace
(open it in ui.perfetto.dev, chrome://tracing or TensorBoard's profiler plugin), and
checks that the trace holds one device event per launch the statistics count (exit 1 if
not).
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import adaptive_eager


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("strict", "adaptive", "compiled"), default="strict")
    parser.add_argument("--trace", default="profile_trace.json", help="where to write the Chrome trace")
    args = parser.parse_args(argv)
    adaptive_eager.enable() if args.mode == "adaptive" else adaptive_eager.disable()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to("neuron")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model, backend="neuron") if args.mode == "compiled" else model
    x, y = torch.randn(32, 64).to("neuron"), torch.randint(0, 10, (32,)).to("neuron")

    def step():
        with record_function("forward"):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer_step"):
            optimizer.step()
            optimizer.zero_grad()
        return loss.item()  # a sync point: the step's kernels are launched inside the region

    for _ in range(2):
        step()
    adaptive_eager.reset_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
                 record_shapes=True, profile_memory=True) as prof:
        step()
    stats = adaptive_eager.stats()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15))
    prof.export_chrome_trace(args.trace)
    with open(args.trace) as handle:
        kernels = sum(1 for event in json.load(handle)["traceEvents"] if event.get("cat") == "kernel")
    print(f"{args.mode}: {stats['ops_recorded']} ops, {stats['kernels_launched']} kernels launched, "
          f"{kernels} kernel events in {args.trace}; simulated device time {stats['device_time_us']:.1f} us")
    return 0 if kernels == stats["kernels_launched"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
