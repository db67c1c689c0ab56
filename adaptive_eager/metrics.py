"""Counters by name and a short text report, modelled on PyTorch/XLA's metrics.

PyTorch/XLA users write ``torch_xla.debug.metrics.metrics_report()`` and
``counter_value("CachedCompile")``; the same habits work here::

    import adaptive_eager
    print(adaptive_eager.metrics_report())
    adaptive_eager.counter_value("kernels_launched")      # -> int
    adaptive_eager.counter_names()                        # every counter that has a value

Counters are integers read from the statistics (:func:`adaptive_eager.stats`), so they
and the ``NEURON_FUSION_STATS`` dump always agree. Plain counters (``kernels_launched``,
``fused_kernels``, ``kernel_cache.hits`` ...) always exist; keyed families appear when
their first event is counted: ``flushes.<reason>``, ``refusals.<reason>``,
``fallback.<aten op>`` (as PyTorch/XLA counts ``aten::`` fallbacks), ``sync_points.<reason>``.
Like PyTorch/XLA, :func:`counter_value` returns ``None`` for a counter that does not
exist. Non-integer figures are *metrics*: :func:`metric_names`, :func:`metric_value`
(``device_time_us``, cache hit rates, peak memory).

Reading waits for the device queue to drain (as :func:`adaptive_eager.stats` does).
"""
from __future__ import annotations

from .report_text import hit_rate
from .statistics import reset_stats, stats

_PLAIN = (
    "ops_recorded", "view_ops", "kernels_launched", "fused_kernels", "ops_fused", "kernels_skipped",
    "bytes_moved", "bytes_saved", "dead_intermediates", "replays",
)
_FAMILIES = (
    ("flushes", lambda d: d["flushes"]["by_reason"]),
    ("refusals", lambda d: d.get("refusals", {})),
    ("fallback", lambda d: d["fallback_ops"]),
    ("sync_points", lambda d: d.get("sync_points", {})),
)


def _counters(data: dict) -> dict:
    out = {name: data.get(name, 0) for name in _PLAIN}
    out["flushes"] = data["flushes"]["total"]
    out["errors.deferred"] = data["errors"]["deferred"]
    out["errors.raised"] = data["errors"]["raised"]
    for cache in ("kernel_cache", "plan_cache"):
        for field in ("hits", "misses", "evictions"):
            out[f"{cache}.{field}"] = data[cache].get(field, 0)
    for family, get in _FAMILIES:
        for key, value in sorted(get(data).items()):
            out[f"{family}.{key}"] = value
    return out


def _metrics(data: dict) -> dict:
    return {
        "device_time_us": float(data["device_time_us"]),
        "kernel_cache.hit_rate": hit_rate(data["kernel_cache"]),
        "plan_cache.hit_rate": hit_rate(data["plan_cache"]),
        "peak_memory_bytes": data.get("memory", {}).get("peak_bytes"),
    }


def counters() -> dict:
    """Every counter, name -> int."""
    return _counters(stats())


def counter_names() -> list[str]:
    """Names of the counters that exist now (plain ones always, keyed ones once counted)."""
    return list(_counters(stats()))


def counter_value(name: str) -> int | None:
    """The value of counter ``name``, or ``None`` if there is no such counter."""
    return _counters(stats()).get(name)


def metric_names() -> list[str]:
    return list(_metrics(stats()))


def metric_value(name: str) -> float | None:
    """``device_time_us`` (simulated), ``kernel_cache.hit_rate``, ``plan_cache.hit_rate``
    (0..1, ``None`` before the first lookup), ``peak_memory_bytes``; ``None`` if unknown."""
    return _metrics(stats()).get(name)


def clear_counters() -> None:
    """Zero every counter and metric (same as :func:`adaptive_eager.reset_stats`)."""
    reset_stats()


def metrics_report(data: dict | None = None) -> str:
    """A short text report: the counters that are not zero, then the metrics.

    ``data`` is a statistics dict (default: the live :func:`adaptive_eager.stats`)."""
    data = stats() if data is None else data
    width = 30
    lines = [f"adaptive_eager metrics (mode: {data['mode']})"]
    nonzero = [(name, value) for name, value in _counters(data).items() if value]
    lines += [f"Counter: {name:<{width}} {value}" for name, value in nonzero] or ["Counter: (all zero)"]
    for name, value in _metrics(data).items():
        if value is None:
            continue
        text = f"{value:.1%}" if name.endswith("hit_rate") else f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"Metric:  {name:<{width}} {text}")
    return "\n".join(lines)

