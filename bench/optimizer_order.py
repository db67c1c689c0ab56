"""AdamW's two implementations on the CPU, in real time: why an eager training step on
``neuron`` carries a few percent more kernel time than the same step in CPU eager.

    python bench/optimizer_order.py [--steps 7]

PyTorch picks AdamW's implementation by device: the multi-tensor one (``foreach``: each op
runs over every parameter before the next op starts) on a device it counts as
foreach-capable (CUDA, and a PrivateUse1 device such as ``neuron``), the for-loop one (each
parameter runs through all the ops in turn) on the CPU. The two issue the same ATen kernels
in another order: the for-loop keeps a parameter's state in cache across its ops, the
multi-tensor one streams all of it from memory once per op. The
device's worker runs what PyTorch issued, on CPU memory, so it pays that difference.

Times ``optimizer.step()`` on the CPU for the parameters of bench/realtime.py's Llama
(hidden 256, 4 layers, vocabulary 4096; random gradients), one intra-op thread, each
implementation alternately, and prints the medians in ms. Only public API.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import realtime  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps of each implementation")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    params = list(realtime._llama(realtime.SIZES["full"]).parameters())
    for param in params:
        param.grad = torch.randn_like(param)
    optimizers = {"for-loop": torch.optim.AdamW(params, lr=1e-3, foreach=False),
                  "foreach": torch.optim.AdamW(params, lr=1e-3, foreach=True)}
    times: dict = {name: [] for name in optimizers}
    for optimizer in optimizers.values():
        optimizer.step()  # the state, allocated once
    for _ in range(args.steps):
        for name, optimizer in optimizers.items():
            started = time.perf_counter()
            optimizer.step()
            times[name].append((time.perf_counter() - started) * 1000)
    count = sum(param.numel() for param in params)
    print(f"AdamW.step on the CPU, {count / 1e6:.1f} M parameters, one thread, median of {args.steps}:")
    for name, samples in times.items():
        print(f"  {name:9} {statistics.median(samples):7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
