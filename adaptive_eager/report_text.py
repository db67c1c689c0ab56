"""Statistics dumps as readable tables: ``python -m adaptive_eager.stats run.json``.

Entry points: :func:`format_stats` (one dump), :func:`format_comparison` (two dumps side
by side with ratios, e.g. strict vs adaptive) and :func:`main` (the CLI).
"""
from __future__ import annotations

import argparse
import json
import sys

from .stats import STATS_VERSION

REQUIRED_KEYS = (
    "mode", "ops_recorded", "kernels_launched", "fused_kernels", "ops_fused", "flushes",
    "patterns", "kernel_cache", "plan_cache", "fallback_ops", "bytes_moved", "bytes_saved",
    "device_time_us", "errors",
)


class StatsFileError(Exception):
    """A statistics file that is missing, malformed or from another version."""


def load(path: str) -> dict:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise StatsFileError(f"{path}: no such file") from None
    except json.JSONDecodeError as error:
        raise StatsFileError(f"{path}: not a JSON statistics dump ({error})") from None
    if not isinstance(data, dict):
        raise StatsFileError(f"{path}: not a statistics dump (top level is not an object)")
    version = data.get("version")
    if version != STATS_VERSION:
        raise StatsFileError(
            f"{path}: statistics version {version!r}, but this adaptive_eager reads version "
            f"{STATS_VERSION}; regenerate the dump with this version"
        )
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise StatsFileError(f"{path}: not a statistics dump (missing {', '.join(missing)})")
    return data


def _rate(cache: dict) -> str:
    lookups = cache.get("hits", 0) + cache.get("misses", 0)
    return f"{100.0 * cache.get('hits', 0) / lookups:.1f}%" if lookups else "-"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def _table(rows, headers) -> list[str]:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(f"{str(x):<{w}}" for x, w in zip(row, widths)) for row in rows]
    return out


def format_stats(data: dict, top: int = 10) -> str:
    lines = [f"neuron fusion statistics (mode: {data['mode']})", ""]
    totals = [
        ("ops recorded", data["ops_recorded"]),
        ("kernels launched", data["kernels_launched"]),
        ("fused kernels", data["fused_kernels"]),
        ("ops fused", data["ops_fused"]),
        ("launches saved", data["ops_recorded"] - data["kernels_launched"]),
        ("bytes moved", _mib(data["bytes_moved"])),
        ("bytes saved", _mib(data["bytes_saved"])),
        ("device time", f"{data['device_time_us'] / 1000:.3f} ms (simulated)"),
        ("errors", f"{data['errors']['deferred']} deferred, {data['errors']['raised']} raised"),
    ]
    lines += [f"  {name:<18}{value}" for name, value in totals]
    flushes = data["flushes"]
    if flushes["total"]:
        lines += ["", f"flushes: {flushes['total']}"]
        lines += [f"  {reason:<30}{n}" for reason, n in sorted(flushes["by_reason"].items(), key=lambda x: -x[1])]
    kernels = data.get("kernels", {})
    fused = [(name, v) for name, v in kernels.items() if "|" in name]
    if fused:
        lines += ["", f"top fused kernels by simulated time (of {len(fused)})"]
        rows = [(name[:70], v["launches"], f"{v['time_us']:.1f}") for name, v in fused[:top]]
        lines += ["  " + line for line in _table(rows, ("kernel", "launches", "time us"))]
    if data["patterns"]:
        lines += ["", "patterns matched"]
        rows = [(name, v["matched"], v["ops"]) for name, v in sorted(data["patterns"].items())]
        lines += ["  " + line for line in _table(rows, ("pattern", "matched", "ops"))]
    refusals = data.get("refusals", {})
    if refusals:
        lines += ["", "fusions refused, by reason"]
        lines += [f"  {reason:<40}{n}" for reason, n in sorted(refusals.items(), key=lambda x: -x[1])]
    lines += ["", "CPU fallback ops: " + (", ".join(f"{k} x{v}" for k, v in sorted(data["fallback_ops"].items())) or "none")]
    lines += [
        "",
        "caches",
        f"  kernel cache  hit rate {_rate(data['kernel_cache'])}  {data['kernel_cache']}",
        f"  plan cache    hit rate {_rate(data['plan_cache'])}  {data['plan_cache']}",
    ]
    return "\n".join(lines)


_COMPARED = (
    ("ops recorded", lambda d: d["ops_recorded"]),
    ("kernels launched", lambda d: d["kernels_launched"]),
    ("fused kernels", lambda d: d["fused_kernels"]),
    ("bytes moved (MiB)", lambda d: d["bytes_moved"] / (1 << 20)),
    ("bytes saved (MiB)", lambda d: d["bytes_saved"] / (1 << 20)),
    ("device time (ms)", lambda d: d["device_time_us"] / 1000),
    ("fallback ops", lambda d: sum(d["fallback_ops"].values())),
)


def format_comparison(first: dict, second: dict, names=("first", "second")) -> str:
    rows = []
    for label, get in _COMPARED:
        a, b = get(first), get(second)
        ratio = f"{b / a:.3f}" if a else "-"
        fmt = (lambda v: f"{v:.3f}") if isinstance(a, float) or isinstance(b, float) else str
        rows.append((label, fmt(a), fmt(b), ratio))
    headers = ("", f"{names[0]} ({first['mode']})", f"{names[1]} ({second['mode']})", "ratio")
    return "\n".join(_table(rows, headers))


def comparison_dict(first: dict, second: dict) -> dict:
    out = {}
    for label, get in _COMPARED:
        a, b = get(first), get(second)
        out[label] = {"first": a, "second": b, "ratio": (b / a) if a else None}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m adaptive_eager.stats",
        description="Print a NEURON_FUSION_STATS dump as a table, or compare two dumps.",
    )
    parser.add_argument("files", nargs="+", metavar="stats.json", help="one dump, or two to compare")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--top", type=int, default=10, help="how many fused kernels to list")
    args = parser.parse_args(argv)
    if len(args.files) > 2:
        parser.error("give one statistics file, or two to compare")
    try:
        dumps = [load(path) for path in args.files]
    except StatsFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if len(dumps) == 1:
        print(json.dumps(dumps[0], indent=2, sort_keys=True) if args.json else format_stats(dumps[0], args.top))
    else:
        if args.json:
            print(json.dumps(comparison_dict(*dumps), indent=2, sort_keys=True))
        else:
            print(format_comparison(*dumps, names=tuple(args.files)))
    return 0
