"""One workload of bench/realtime.py in one mode, alone (no CPU eager steps in between), for profilers.

    python bench/realtime_profile.py generate compiled [--warmup 3] [--steps 40] [--cprofile out.prof]
        [--ready FILE]

Builds the model as ``bench/realtime.py`` does (``realtime.build``), runs ``--warmup``
steps (compiling, planning, building kernels), then ``--steps`` timed steps (compiled
modes: after waiting for the fused kernels Inductor generates in the background), and
prints per step: wall ms, the host's CPU ms (the process's CPU time less the device
worker's), the device worker thread's CPU ms, and the garbage collections that ran (count
and ms, from ``gc.callbacks``), as medians. ``--cprofile PATH`` profiles the timed steps
only (cProfile sees the host thread). ``--ready FILE`` writes the process id to FILE when the timed steps
start, so a sampling profiler can attach for the steady state only; on SIGTERM the timed
steps stop and the figures of those that ran are printed (for the profile's steps per second)::

    python bench/realtime_profile.py generate compiled --steps 200 --ready /tmp/ready &
    while [ ! -s /tmp/ready ]; do sleep 0.2; done
    py-spy record --threads --gil --native --pid $(cat /tmp/ready) --duration 10 -f raw -o compiled.txt
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import realtime  # noqa: E402


def _worker_thread():
    """The device worker (a C++ thread: ``Worker.cpu_seconds`` reads its CPU clock), or
    None on the CPU."""
    try:
        from adaptive_eager_device.hardware.execution_queue import QUEUE
    except ImportError:
        return None
    return QUEUE._worker


def _thread_cpu(worker) -> float:
    return 0.0 if worker is None else worker.cpu_seconds()
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:  # ended
        return 0.0


class _GcWatch:
    def __init__(self) -> None:
        self.count, self.seconds, self.by_generation, self._start = 0, 0.0, [0, 0, 0], None

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self.by_generation[info["generation"]] += 1
            self._start = None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=realtime.WORKLOADS + realtime.FIRST_STEP_WORKLOADS)
    parser.add_argument("mode", choices=realtime.FIRST_STEP_MODES)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", choices=sorted(realtime.SIZES), default="full")
    parser.add_argument("--cprofile", default=None, help="write cProfile stats of the timed steps here")
    parser.add_argument("--ready", default=None, help="write the pid here when the timed steps start")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.mode in realtime.NEURON_MODES:
        import adaptive_eager

        adaptive_eager.enable() if args.mode == "adaptive" else adaptive_eager.disable()
    import warnings

    warnings.simplefilter("ignore")
    step, _ = realtime.build(args.workload, args.mode, realtime.SIZES[args.size])
    for _ in range(args.warmup):
        step()
    if args.mode.startswith("compiled"):
        import adaptive_eager

        # as bench/realtime.py does: the timed steps run the fused kernels Inductor generates
        # in the background, not the ATen kernels that stand in until they are compiled
        adaptive_eager.wait_for_generated_kernels(1800)
    watch = _GcWatch()
    gc.callbacks.append(watch)
    profiler = cProfile.Profile() if args.cprofile else None
    if args.ready:
        with open(args.ready, "w") as handle:
            handle.write(str(os.getpid()))
    walls, hosts, workers, gcs, gc_ms = [], [], [], [], []
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    for _ in range(args.steps):
        if stop:
            break
        worker = _worker_thread()
        count, seconds = watch.count, watch.seconds
        wall0, cpu0, worker0 = time.perf_counter(), time.process_time(), _thread_cpu(worker)
        if profiler:
            profiler.enable()
        step()
        if profiler:
            profiler.disable()
        worker_cpu = _thread_cpu(worker) - worker0
        walls.append(time.perf_counter() - wall0)
        hosts.append(time.process_time() - cpu0 - worker_cpu)
        workers.append(worker_cpu)
        gcs.append(watch.count - count)
        gc_ms.append((watch.seconds - seconds) * 1000)
    gc.callbacks.remove(watch)
    if profiler:
        profiler.dump_stats(args.cprofile)
    print(json.dumps({
        "workload": args.workload, "mode": args.mode, "steps": len(walls), "stopped_early": bool(stop), "cpus": sorted(os.sched_getaffinity(0)),
        "wall_ms": statistics.median(walls) * 1000, "host_cpu_ms": statistics.median(hosts) * 1000,
        "worker_cpu_ms": statistics.median(workers) * 1000,
        "gc_per_step": sum(gcs) / len(gcs), "gc_ms_per_step": sum(gc_ms) / len(gc_ms),
        "gc_by_generation": watch.by_generation, "gc_max_ms": max(gc_ms),
        "profiled": bool(profiler),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
