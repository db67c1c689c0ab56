"""Measure one workload in one mode, in this process; print one JSON object.

    python -m bench.measure <workload> <mode> [--steps N] [--warmup W] [--vs-wrapper]

Modes: ``cpu`` (CPU eager, the reference), ``wrapper`` (CPU eager through a thin
pass-through ``__torch_dispatch__`` wrapper subclass, ``bench/wrapper.py``: the floor of a
Python-level device's host cost), ``strict`` and ``adaptive`` (``neuron``),
``adaptive-torchneuron`` (adaptive eager under TorchNeuron's own policy,
``NEURON_ADAPTIVE_POLICY=torchneuron``: ``adaptive_eager/policies.py``),
``neuron-compiled`` (``torch.compile`` of the step on ``neuron``: the ``neuron`` backend,
whole graphs through the fusion engine), ``compile`` (``torch.compile``, Inductor on the
CPU). ``python -m bench`` runs one of these
per workload and mode, each in a fresh process, so caches, random state and peak memory
never leak from one measurement into another.

How each figure is taken:

- wall ms per step: the median over ``--steps`` steps after ``--warmup`` steps, each step
  ending in a device-to-host copy of its result (a sync point);
- host us per op: the CPU time of every host thread per step (the main thread and
  autograd's engine thread: the process's CPU time minus the device worker thread's),
  divided by the ops of a step. Waiting for the device or for the GIL costs no CPU time.
  PyTorch runs with one intra-op thread in every mode (two cores: one for the host, one
  for the simulated device), so no thread pool hides in these figures;
- host us per kernel (neuron modes): the same host CPU time per step divided by the
  kernels launched per step: what the host pays for each launch (compiled mode's replay,
  ``adaptive_eager/replay.py``, launches without per-op dispatch);
- wall vs CPU eager (neuron modes): the median, over the timed steps, of each step's wall
  time over the wall time of a CPU eager step run just before it in the same process
  (interleaved, so the ratio holds when the shared machine's speed drifts);
- wall and host vs the wrapper (strict and adaptive with ``--vs-wrapper``): the wrapper's
  step runs interleaved too (CPU eager, wrapper, neuron, in turn), and each ratio is the
  median over the timed steps of that step's figure over the wrapper step's just before
  it: wall time, and host CPU time per op (the wrapper's ops are CPU eager's). The
  wrapper runs its CPU kernels on the host thread, so its host time per op holds their
  compute too; its overhead per op is its host CPU time less the CPU eager step's just
  before it, over its ops: what wrapping alone costs;
- ops per step: aten ops reaching the device (neuron modes) or run by CPU eager (counted
  once by a dispatch mode, outside the timed steps; views excluded in both; for
  ``compile``, the eager program's count; for ``wrapper``, CPU eager's);
- kernel launches per step: neuron: launches on the execution queue; CPU eager: one per op;
  Inductor: the kernels it generated plus its calls to extern kernels (matmul, conv...),
  counted from one profiled step with ``cpp.enable_kernel_profile``;
- device time and bytes per step: the cost model's (neuron modes only);
- max abs diff: against the CPU eager result of the same step, computed by this process;
- peak memory: simulated device memory (neuron), else the process's peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workloads import WORKLOADS  # noqa: E402
from bench.wrapper import build_wrapped  # noqa: E402


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run under it: views excluded, unless ``views``."""

    def __init__(self, views: bool = False) -> None:
        super().__init__()
        self.ops = 0
        self.views = views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.views or not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _inductor_kernels_per_step(step) -> int:
    """Kernels one compiled step runs: Inductor's generated C++ kernels (``cpp_fused_*``,
    visible with ``cpp.enable_kernel_profile``) plus the aten ops a compiled graph calls
    directly (extern kernels: matmul, conv...), from one profiled step."""
    from torch.profiler import profile

    with profile() as prof:
        step()
    kernels = 0
    for event in prof.events():
        if "cpp_fused" in event.name:
            kernels += 1
        elif event.name.startswith("aten::"):
            parent = event.cpu_parent
            if parent is not None and parent.name.startswith("## Call CompiledFxGraph"):
                kernels += 1
    return kernels


def _worker_cpu_seconds() -> float:
    """CPU time of the device worker thread so far (0 when there is none)."""
    try:
        from adaptive_eager_device.hardware.execution_queue import QUEUE
    except ImportError:
        return 0.0
    worker = QUEUE._worker
    return 0.0 if worker is None else worker.cpu_seconds()


def _count_ops(eager_step) -> int:
    """Ops one eager CPU step runs (views excluded), past the first step's one-off work."""
    eager_step()  # optimizer state
    counter = _CountOps()
    with counter:  # on eager code only: a dispatch mode would make Dynamo recompile
        eager_step()
    return counter.ops


def _timed(step):
    """Run one step: (its result, wall seconds, host CPU seconds without the device worker's)."""
    started, cpu_started, worker_started = time.perf_counter(), time.process_time(), _worker_cpu_seconds()
    out = step()
    cpu = (time.process_time() - cpu_started) - (_worker_cpu_seconds() - worker_started)
    return out, time.perf_counter() - started, cpu


def measure(workload_name: str, mode: str, steps: int, warmup: int, vs_wrapper: bool = False) -> dict:
    torch.set_num_threads(1)
    workload = WORKLOADS[workload_name]
    reference = cpu_step = wrapper_step = None
    if mode != "cpu":
        cpu_step = workload.build("cpu")
        for _ in range(warmup):
            reference = cpu_step()
    if vs_wrapper and mode in ("strict", "adaptive"):
        wrapper_step = build_wrapped(workload)
        for _ in range(warmup):
            wrapper_step()
    result: dict = {"workload": workload_name, "mode": mode}
    device = "neuron" if mode in ("strict", "adaptive", "adaptive-torchneuron", "neuron-compiled") else "cpu"
    if device == "neuron":
        import adaptive_eager
        from adaptive_eager_device.core.config import CONFIG

        adaptive_eager.enable() if mode.startswith("adaptive") else adaptive_eager.disable()
        CONFIG.adaptive_policy = "torchneuron" if mode == "adaptive-torchneuron" else "ours"
    compile_seconds = None
    if mode == "neuron-compiled":  # eager ops between graphs (graph breaks) run strict
        step = torch.compile(workload.build("neuron"))
        started = time.perf_counter()
        step()
        compile_seconds = time.perf_counter() - started
        warmup -= 1
    elif mode == "compile":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
        eager_step = workload.build("cpu")
        step = torch.compile(eager_step)
        started = time.perf_counter()
        step()
        compile_seconds = time.perf_counter() - started
        warmup -= 1
    elif mode == "wrapper":
        step = build_wrapped(workload)
    else:
        step = workload.build(device)
    for _ in range(max(warmup, 0)):
        out = step()
    if device == "neuron":
        import adaptive_eager

        adaptive_eager.reset_stats()
        torch.neuron.reset_peak_memory_stats()
    walls, cpus, cpu_walls, cpu_cpus, wrapper_walls, wrapper_cpus = [], [], [], [], [], []
    for _ in range(steps):
        if cpu_step is not None:  # CPU eager interleaved: a ratio that holds when the machine's speed drifts
            reference, wall, cpu = _timed(cpu_step)
            cpu_walls.append(wall)
            cpu_cpus.append(cpu)
        if wrapper_step is not None:
            _, wall, cpu = _timed(wrapper_step)
            wrapper_walls.append(wall)
            wrapper_cpus.append(cpu)
        out, wall, cpu = _timed(step)
        walls.append(wall)
        cpus.append(cpu)
    result["wall_ms_per_step"] = statistics.median(walls) * 1000
    if device == "neuron":
        import adaptive_eager

        stats = adaptive_eager.stats()
        ops = stats["ops_recorded"] / steps
        result.update(
            ops_per_step=ops,
            launches_per_step=stats["kernels_launched"] / steps,
            device_time_us_per_step=stats["device_time_us"] / steps,
            bytes_per_step=stats["bytes_moved"] / steps,
            fused_kernels_per_step=stats["fused_kernels"] / steps,
            fallback_ops=stats["fallback_ops"],
            compiled_graph_calls_per_step=stats["compiled"]["graph_calls"] / steps,
            compiled_replays_per_step=stats["compiled"]["replays"] / steps,
            compiled_replay_fallbacks=stats["compiled"]["replay_fallbacks"],
            host_us_per_kernel=statistics.median(cpus) / max(stats["kernels_launched"] / steps, 1) * 1e6,
            peak_memory_bytes=torch.neuron.max_memory_allocated(),
            peak_memory_kind="simulated device memory",
        )
    else:
        if mode == "cpu":  # the step itself, one step further on (it has its optimizer state)
            counter = _CountOps()
            with counter:
                step()
            ops = counter.ops
        else:
            ops = _count_ops(workload.build("cpu"))
        result["ops_per_step"] = ops
        result["launches_per_step"] = ops if mode in ("cpu", "wrapper") else _inductor_kernels_per_step(step)
        result["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["peak_memory_kind"] = "process peak RSS"
    result["host_us_per_op"] = statistics.median(cpus) / max(ops, 1) * 1e6
    if cpu_walls:
        result["cpu_eager_wall_ms_per_step"] = statistics.median(cpu_walls) * 1000
        result["wall_vs_cpu_eager"] = statistics.median(w / c for w, c in zip(walls, cpu_walls))
    if wrapper_walls:
        wrapper_ops = _count_ops(workload.build("cpu"))
        result["wrapper_ops_per_step"] = wrapper_ops
        result["wrapper_wall_ms_per_step"] = statistics.median(wrapper_walls) * 1000
        result["wrapper_host_us_per_op"] = statistics.median(wrapper_cpus) / max(wrapper_ops, 1) * 1e6
        result["wall_vs_wrapper"] = statistics.median(w / c for w, c in zip(walls, wrapper_walls))
        result["host_per_op_vs_wrapper"] = statistics.median(
            (c / max(ops, 1)) / (wc / max(wrapper_ops, 1)) for c, wc in zip(cpus, wrapper_cpus))
        result["wrapper_overhead_us_per_op"] = statistics.median(
            (wc - cc) / max(wrapper_ops, 1) for wc, cc in zip(wrapper_cpus, cpu_cpus)) * 1e6
    if compile_seconds is not None:
        result["compile_seconds"] = compile_seconds
    if reference is not None:
        result["max_abs_diff"] = float((out.double() - reference.double()).abs().max()) if out.is_floating_point() else float((out != reference).sum())
    else:
        result["max_abs_diff"] = 0.0
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="measure one workload in one mode (see bench/measure.py)")
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("mode", choices=["cpu", "wrapper", "strict", "adaptive", "adaptive-torchneuron", "neuron-compiled",
                                         "compile"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vs-wrapper", action="store_true",
                        help="strict/adaptive: also run the pass-through wrapper's step, interleaved")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.workload, args.mode, args.steps, args.warmup, args.vs_wrapper)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
