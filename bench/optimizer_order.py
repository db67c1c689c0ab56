"""AdamW's two implementations on the CPU, in real time, with glibc's default heap and with
the device's: how much of a training step on ``neuron`` the optimizer's order costs, and
how much the C allocator.

    python bench/optimizer_order.py [--steps 7]

PyTorch picks AdamW's implementation by device: the multi-tensor one (``foreach``: each op
runs over every parameter before the next op starts) on a device it counts as
foreach-capable (CUDA, and a PrivateUse1 device such as ``neuron``), the for-loop one (each
parameter runs through all the ops in turn) on the CPU. The two issue the same ATen kernels
in another order: the for-loop keeps a parameter's state in cache across its ops, the
multi-tensor one streams all of it from memory once per op, and holds every parameter's
temporaries (``_foreach_sqrt``'s) at once. With glibc's defaults those temporaries are
blocks it maps afresh and returns to the OS every step, so each one is faulted in again;
the device keeps freed memory (``storage.keep_freed_memory`` for the host thread, whose
heap setting applies to the whole process, and a pool of its own for the worker's kernels,
``device/csrc/host_pool.cpp``).

Times ``optimizer.step()`` on the CPU for the parameters of bench/realtime.py's Llama
(hidden 256, 4 layers, vocabulary 4096; random gradients), one intra-op thread, each
implementation alternately, first with glibc's default heap, then with the device's
setting (which cannot be undone in the process), and prints the medians in ms.
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
from adaptive_eager_device.memory.storage import keep_freed_memory  # noqa: E402


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
    for optimizer in optimizers.values():
        optimizer.step()  # the state, allocated once
    count = sum(param.numel() for param in params)
    print(f"AdamW.step on the CPU, {count / 1e6:.1f} M parameters, one thread, median of {args.steps}:")
    for heap in ("glibc's default heap", "the device's heap setting"):
        if heap != "glibc's default heap" and not keep_freed_memory():
            print("  (not glibc: no heap setting to apply)")
            break
        times: dict = {name: [] for name in optimizers}
        for _ in range(args.steps):
            for name, optimizer in optimizers.items():
                started = time.perf_counter()
                optimizer.step()
                times[name].append((time.perf_counter() - started) * 1000)
        print(f"  {heap}:")
        for name, samples in times.items():
            print(f"    {name:9} {statistics.median(samples):7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
