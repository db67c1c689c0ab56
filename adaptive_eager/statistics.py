"""The fusion-statistics dump (a contract: docs/ARCHITECTURE.md, "Statistics").

Entry points: :func:`stats` (the dict), :func:`reset_stats`, :data:`FUSION` (the
adaptive runtime's counters). ``python -m adaptive_eager.stats <file.json>`` prints a dump
as a table (``adaptive_eager/stats.py``, the command, and ``report_text.py``).

``NEURON_FUSION_STATS=<path>`` writes ``stats()`` as JSON when the process exits.
"""
from __future__ import annotations

import atexit
import json
from collections import Counter

from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware.cost_model import PROFILE
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.hardware.execution_queue import QUEUE
from adaptive_eager_device.core.reasons import Flush
from adaptive_eager_device.memory.storage import MEMORY
from adaptive_eager_device.hardware.sink import current_sink, flush

from . import generated

STATS_VERSION = 1


class FusionCounters:
    """Counters of the adaptive runtime (zero in strict mode)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.fused_kernels = 0  # launches that ran more than one op
        self.ops_fused = 0  # ops that ran inside those launches
        self.flushes: Counter = Counter()  # reason -> window flushes
        self.patterns: dict = {}  # name -> {"matched": n, "ops": n}
        self.refusals: Counter = Counter()  # reason -> fusions refused
        self.bytes_saved = 0
        self.dead_intermediates = 0  # outputs never written back to device memory
        self.replays = 0  # fused kernels replayed op by op after a failure
        self.caches: dict = {}  # name -> object with .stats() -> dict

    def pattern(self, name: str, ops: int, kernels: int = 1) -> None:
        """``kernels`` library kernels of pattern ``name`` launched, ``ops`` ops in all."""
        entry = self.patterns.setdefault(name, {"matched": 0, "ops": 0})
        entry["matched"] += kernels
        entry["ops"] += ops


FUSION = FusionCounters()


class CompiledCounters:
    """Counters of compiled mode (``adaptive_eager/compiler.py``): Dynamo graphs captured,
    recompiles and why, and per AOTAutograd graph its calls, ops and launches."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.captures = 0  # Dynamo graphs handed to the neuron backend
        self.recompiles: list = []  # the failed guard that made each recompile
        self.graphs: dict = {}  # id -> {"kind", "nodes", "calls", "ops", "launches"}
        self.caches: dict = {}  # id -> {"plan_cache": CountingLRU, "kernel_cache": KernelCache}

    def captured(self, recompile_reason) -> None:
        self.captures += 1
        if recompile_reason is not None:
            self.recompiles.append(recompile_reason)

    def graph(self, graph_id: int, kind: str, nodes: int, caches: dict) -> dict:
        entry = self.graphs[graph_id] = {"kind": kind, "nodes": nodes, "calls": 0, "ops": 0, "launches": 0,
                                         "replays": 0, "replayed_ops": 0, "replay_fallbacks": {},
                                         "replay_signatures": 0}
        self.caches[graph_id] = caches
        return entry

    def as_dict(self) -> dict:
        graphs = self.graphs.values()
        return {
            "graphs_captured": self.captures,
            "recompiles": {"total": len(self.recompiles), "reasons": list(self.recompiles)},
            "graph_calls": sum(g["calls"] for g in graphs),
            "ops": sum(g["ops"] for g in graphs),
            "launches": sum(g["launches"] for g in graphs),
            "replays": sum(g["replays"] for g in graphs),
            "replayed_ops": sum(g["replayed_ops"] for g in graphs),
            "replay_fallbacks": dict(sum((Counter(g["replay_fallbacks"]) for g in graphs), Counter())),
            "generated_kernels": generated.counts(),
            "graphs": {str(k): dict(v, **{name: cache.stats() for name, cache in self.caches[k].items()})
                       for k, v in self.graphs.items()},
        }


COMPILED = CompiledCounters()


def _plain(reasons) -> dict:
    """A Counter of reasons (``device/core/reasons.py`` members, or members with a detail) as
    plain strings, as the dump and the CLIs show them."""
    return {str(reason): count for reason, count in reasons.items()}


def _cache_stats(name: str) -> dict:
    cache = FUSION.caches.get(name)
    if cache is None:
        return {"hits": 0, "misses": 0, "evictions": 0, "size": 0}
    return cache.stats()


def _distributed_stats() -> dict:
    """This rank's collectives: calls, bytes moved over the link and simulated time, in
    all and per op (``device/ops/collectives.py``)."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    by_op = {name: {"calls": calls, "bytes": nbytes, "time_us": round(time_us, 3)}
             for name, (calls, nbytes, time_us) in sorted(COUNTERS.collective_totals.items())}
    return {
        "rank": dist.get_rank() if initialized else None,
        "world_size": dist.get_world_size() if initialized else None,
        "collectives": sum(op["calls"] for op in by_op.values()),
        "bytes": sum(op["bytes"] for op in by_op.values()),
        "time_us": round(sum(time_us for _, _, time_us in COUNTERS.collective_totals.values()), 3),
        "by_op": by_op,
    }


def stats() -> dict:
    """Everything the runtime counted since start-up or the last :func:`reset_stats`.

    Waits for the queue to drain first, so device-side figures are complete. Ops still
    buffered in an adaptive window are counted as recorded, not yet as launched.
    """
    QUEUE.drain()
    kernels = sorted(QUEUE.kernel_summary().items(), key=lambda item: -item[1][1])
    return {
        "version": STATS_VERSION,
        "mode": "adaptive" if current_sink().name == "adaptive" else "strict",
        "policy": CONFIG.adaptive_policy if current_sink().name == "adaptive" else None,
        "ops_recorded": COUNTERS.ops_recorded,
        "kernels_launched": COUNTERS.kernels_launched,
        "fused_kernels": FUSION.fused_kernels,
        "ops_fused": FUSION.ops_fused,
        "flushes": {"total": sum(FUSION.flushes.values()), "by_reason": _plain(FUSION.flushes)},
        "patterns": {name: dict(value) for name, value in FUSION.patterns.items()},
        "kernel_cache": _cache_stats("kernel_cache"),
        "plan_cache": _cache_stats("plan_cache"),
        "fallback_ops": dict(COUNTERS.fallback_ops),
        "bytes_moved": COUNTERS.bytes_moved,
        "bytes_saved": FUSION.bytes_saved,
        "device_time_us": round(COUNTERS.device_time_us, 3),
        "errors": {"deferred": COUNTERS.errors_deferred, "raised": COUNTERS.errors_raised},
        # beyond the contract
        "refusals": _plain(FUSION.refusals),
        "dead_intermediates": FUSION.dead_intermediates,
        "replays": FUSION.replays,
        "view_ops": COUNTERS.view_ops,
        "kernels_skipped": COUNTERS.kernels_skipped,
        "sync_points": _plain(COUNTERS.sync_points),
        "collectives": dict(COUNTERS.collectives),
        "distributed": _distributed_stats(),
        "launches_by_stream": {str(k): v for k, v in COUNTERS.launches_by_stream.items()},
        "kernels": {name: {"launches": n, "time_us": round(t, 3), "bytes": b} for name, (n, t, b) in kernels},
        "memory": {"peak_bytes": MEMORY.peak, "allocated_bytes": MEMORY.allocated},
        "device": {"name": PROFILE.name, "launch_overhead_us": PROFILE.launch_overhead_us, "lnc": PROFILE.lnc},
        "compiled": COMPILED.as_dict(),
    }


def reset_stats() -> None:
    """Zero every counter (cache contents are kept; their counters restart). Ops still in
    an adaptive window are launched first, so nothing recorded before is counted after."""
    flush(Flush.RESET_STATS)
    QUEUE.drain()
    COUNTERS.reset()
    QUEUE.reset_kernel_summary()
    caches = FUSION.caches
    FUSION.reset()
    FUSION.caches = caches
    for entry in COMPILED.graphs.values():  # graphs stay compiled; their counters restart
        entry.update(calls=0, ops=0, launches=0, replays=0, replayed_ops=0, replay_fallbacks={})
    for graph_caches in COMPILED.caches.values():
        for cache in graph_caches.values():
            cache.reset_counters()
    COMPILED.captures = 0
    COMPILED.recompiles.clear()
    generated.reset_counts()
    for cache in caches.values():
        cache.reset_counters()
    MEMORY.peak = MEMORY.allocated


def dump(path: str) -> None:
    with open(path, "w") as handle:
        json.dump(stats(), handle, indent=2, sort_keys=True)
        handle.write("\n")


def _dump_at_exit() -> None:
    path = CONFIG.stats_path
    if path:
        flush(Flush.EXIT)
        dump(path)


def install_exit_dump() -> None:
    """Called once by ``import adaptive_eager``: the dump at exit, when
    ``NEURON_FUSION_STATS`` asks for one."""
    if CONFIG.stats_path:
        atexit.register(_dump_at_exit)

