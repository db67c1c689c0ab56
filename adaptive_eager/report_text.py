"""Statistics dumps as readable tables: ``python -m adaptive_eager.stats run.json``.

Entry points: :func:`load` (read and check a ``NEURON_FUSION_STATS`` dump),
:func:`summary` (the figures people ask about, derived from one dump: what ``--json``
prints), :func:`kernel_rows` and :func:`hit_rate` (shared with the HTML report,
:mod:`adaptive_eager.report`), :func:`format_stats` (one dump),
:func:`format_comparison` (two dumps side by side with ratios, e.g. strict vs adaptive)
and :func:`main` (the CLI). A bad file is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from adaptive_eager_device.core.reasons import explain  # noqa: F401 (the report's too)

from .statistics import STATS_VERSION

REQUIRED_KEYS = (
    "mode", "ops_recorded", "kernels_launched", "fused_kernels", "ops_fused", "flushes",
    "patterns", "kernel_cache", "plan_cache", "fallback_ops", "bytes_moved", "bytes_saved",
    "device_time_us", "errors",
)
_NUMBERS = ("ops_recorded", "kernels_launched", "fused_kernels", "ops_fused", "bytes_moved", "bytes_saved", "device_time_us")
_COUNTS = ("fallback_ops", "refusals")  # name -> int


class StatsFileError(Exception):
    """A statistics file that is missing, malformed or from another version."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shape_error(data: dict) -> str | None:
    """What is wrong with the shape of a dump, or None."""
    for key in _NUMBERS:
        if not _is_number(data[key]):
            return f'"{key}" is {data[key]!r}, not a number'
    flushes = data["flushes"]
    if not (isinstance(flushes, dict) and _is_number(flushes.get("total")) and isinstance(flushes.get("by_reason"), dict)):
        return '"flushes" is not {"total": n, "by_reason": {...}}'
    for key in ("kernel_cache", "plan_cache"):
        cache = data[key]
        if not (isinstance(cache, dict) and _is_number(cache.get("hits")) and _is_number(cache.get("misses"))):
            return f'"{key}" has no numeric "hits" and "misses"'
    errors = data["errors"]
    if not (isinstance(errors, dict) and _is_number(errors.get("deferred")) and _is_number(errors.get("raised"))):
        return '"errors" is not {"deferred": n, "raised": n}'
    for key in _COUNTS + ("by_reason",):
        table = flushes["by_reason"] if key == "by_reason" else data.get(key, {})
        if not isinstance(table, dict) or not all(_is_number(v) for v in table.values()):
            return f'"{key}" is not a table of counts'
    if not isinstance(data["patterns"], dict) or not all(isinstance(v, dict) for v in data["patterns"].values()):
        return '"patterns" is not {name: {"matched", "ops"}}'
    kernels = data.get("kernels", {})
    if not isinstance(kernels, dict) or not all(
        isinstance(v, dict) and all(_is_number(v.get(k)) for k in ("launches", "time_us", "bytes")) for v in kernels.values()
    ):
        return '"kernels" is not {name: {"launches", "time_us", "bytes"}}'
    return None


def read_json(path: str, what: str = "JSON statistics dump"):
    """Parse a JSON file; raise :class:`StatsFileError` with a one-line reason."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise StatsFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise StatsFileError(f"{path}: is a directory, not a file") from None
    except PermissionError:
        raise StatsFileError(f"{path}: permission denied") from None
    except UnicodeDecodeError:
        raise StatsFileError(f"{path}: not a {what} (not UTF-8 text)") from None
    except json.JSONDecodeError as error:
        raise StatsFileError(f"{path}: not a {what} ({error})") from None


def load(path: str) -> dict:
    """Read a dump; raise :class:`StatsFileError` with a one-line reason if it is not one."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise StatsFileError(f"{path}: not a statistics dump (top level is not an object)")
    if "traceEvents" in data:
        raise StatsFileError(f"{path}: a NEURON_TRACE timeline, not a NEURON_FUSION_STATS dump")
    if "version" not in data:
        raise StatsFileError(f'{path}: not a NEURON_FUSION_STATS dump (no "version" key)')
    version = data["version"]
    if version != STATS_VERSION:
        raise StatsFileError(
            f"{path}: statistics version {version!r}, but this adaptive_eager reads version "
            f"{STATS_VERSION}; regenerate the dump with this version"
        )
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise StatsFileError(f"{path}: not a statistics dump (missing {', '.join(missing)})")
    problem = _shape_error(data)
    if problem:
        raise StatsFileError(f"{path}: malformed statistics dump ({problem})")
    return data


# What two figures mean, in the same words in the CLI, the HTML report and the demo.
KERNEL_CACHE_NOTE = (
    "The kernel cache is looked up only while a window is planned, i.e. on a plan-cache miss; "
    "a plan-cache hit reuses the plan's kernels and skips it. So a low kernel-cache hit rate next to "
    "a high plan-cache hit rate means each distinct fused kernel was described once, then reused "
    "through the plan cache."
)


def launch_overhead_us(data: dict) -> float:
    """The launch overhead a dump was simulated with (NEURON_SIM_LAUNCH_US)."""
    device = data.get("device")
    if isinstance(device, dict) and _is_number(device.get("launch_overhead_us")):
        return float(device["launch_overhead_us"])
    from adaptive_eager_device.hardware.cost_model import PROFILE

    return float(PROFILE.launch_overhead_us)


def launch_share(data: dict) -> float | None:
    """The part of simulated device time that is launch overhead (launches x overhead)."""
    total = data["device_time_us"]
    return min(1.0, data["kernels_launched"] * launch_overhead_us(data) / total) if total else None


def device_time_note(data: dict) -> str:
    """Simulated device time, explained with this dump's own figures."""
    overhead = launch_overhead_us(data)
    launches = data["kernels_launched"]
    return (
        "Simulated device time is the simulator's cost model, not hardware: each kernel costs an assumed "
        f"launch overhead of {overhead:g} us (NEURON_SIM_LAUNCH_US) plus the busiest of its engines and its "
        f"memory traffic on one logical NeuronCore of Trainium2 (published figures). Here {launches} launches x "
        f"{overhead:g} us = "
        f"{launches * overhead / 1000:.3f} ms, {_pct(launch_share(data))} of it"
        + (": it is mostly the launch count, which is what adaptive eager cuts." if (launch_share(data) or 0) >= 0.5 else ".")
    )


# -- derived figures ---------------------------------------------------------------------
def hit_rate(cache: dict) -> float | None:
    lookups = cache.get("hits", 0) + cache.get("misses", 0)
    return cache.get("hits", 0) / lookups if lookups else None


def kernel_ops(name: str) -> tuple:
    """(library pattern or None, the chain's ops, copies) of a kernel name. Names, from
    fusion/kernels.py: ``aten::mul`` (one op), ``mul|add|relu`` (a fused chain),
    ``mul_|add_ x4`` (four independent copies of a chain in one launch), and
    ``silu(sigmoid|mul)`` (a chain run as a library pattern's kernel)."""
    pattern = None
    if name.endswith(")") and "(" in name:
        pattern, name = name[:-1].split("(", 1)
    base, sep, copies = name.rpartition(" x")
    if sep and copies.isdigit():
        return pattern, base.split("|"), int(copies)
    return pattern, name.split("|"), 1


def kernel_rows(data: dict, fused: bool) -> list[dict]:
    """Fused (more than one op per launch) or single-op kernels, most simulated time first.

    The dump's ``kernels`` object is written with sorted keys, so order is rebuilt here."""
    rows = []
    for name, v in data.get("kernels", {}).items():
        pattern, chain, copies = kernel_ops(name)
        if (len(chain) * copies > 1) == fused:
            rows.append({"name": name, "ops": len(chain) * copies, "copies": copies, "pattern": pattern,
                         "launches": v["launches"], "time_us": v["time_us"], "bytes": v["bytes"]})
    rows.sort(key=lambda row: (-row["time_us"], -row["launches"], row["name"]))
    return rows


def summary(data: dict, top: int = 10) -> dict:
    """The figures the report answers with, derived from one dump."""
    fused = kernel_rows(data, fused=True)
    fused_time = sum(row["time_us"] for row in fused)
    ops, launches = data["ops_recorded"], data["kernels_launched"]
    caches = {}
    for key in ("kernel_cache", "plan_cache"):
        caches[key] = dict(data[key], hit_rate=hit_rate(data[key]))
    return {
        "mode": data["mode"],
        "ops_recorded": ops,
        "kernels_launched": launches,
        "launches_saved": ops - launches,
        "ops_per_launch": ops / launches if launches else None,
        "fused_kernels": data["fused_kernels"],
        "ops_fused": data["ops_fused"],
        "distinct_fused_kernels": len(fused),
        "device_time_us": data["device_time_us"],
        "fused_time_share": fused_time / data["device_time_us"] if data["device_time_us"] else None,
        "bytes_moved": data["bytes_moved"],
        "bytes_saved": data["bytes_saved"],
        "flushes": data["flushes"],
        "patterns": data["patterns"],
        "refusals": data.get("refusals", {}),
        "fallback_ops": data["fallback_ops"],
        "errors": data["errors"],
        "caches": caches,
        "peak_memory_bytes": data.get("memory", {}).get("peak_bytes"),
        "top_fused_by_time": fused[:top],
        "top_fused_by_launches": sorted(fused, key=lambda row: (-row["launches"], -row["time_us"], row["name"]))[:top],
        "top_single_op_by_time": kernel_rows(data, fused=False)[:top],
    }


# -- text --------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def short_name(name: str, width: int = 60) -> str:
    """A fused kernel's chain in at most ``width`` characters: its first ops, cut at an op
    boundary, and how many more follow (``ones|triu|masked_fill|… +12 ops``). Never cut in
    the middle: kernels of one model share their first and last ops, so two middle-cut
    names looked alike. Where the label is short, show the whole name next to it."""
    if len(name) <= width:
        return name
    head = name[: max(width - 10, 1)]
    cut = head.rfind("|")
    head = head[:cut] if cut > 0 else head
    more = name[len(head):].count("|") or 1
    return f"{head}|… +{more} ops"


def _table(rows, headers, right=()) -> list[str]:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]

    def line(cells):
        return "  ".join(f"{str(x):>{w}}" if i in right else f"{str(x):<{w}}" for i, (x, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths)] + [line(row) for row in rows]


def _counts(title: str, table: dict, empty: str, note: str = "") -> list[str]:
    if not table:
        return ["", f"{title}: {empty}"]
    rows = sorted(table.items(), key=lambda item: (-item[1], item[0]))
    return ["", f"{title} ({sum(table.values())}{note})"] + ["  " + l for l in _table(rows, ("reason", "count"), right=(1,))[2:]]


def _explained(title: str, table: dict, empty: str, note: str = "") -> list[str]:
    """A table of flush or refusal reasons with their meaning (``device/core/reasons.py``)."""
    if not table:
        return ["", f"{title}: {empty}"]
    rows = [(reason, n, explain(reason)) for reason, n in sorted(table.items(), key=lambda item: (-item[1], item[0]))]
    return ["", f"{title} ({sum(table.values())}{note})"] + ["  " + l for l in _table(rows, ("reason", "count", "meaning"), right=(1,))[2:]]


def _kernels(title: str, rows: list[dict], total_us: float) -> list[str]:
    # The kernel's whole name, last: never cut (cut names of one model's kernels look alike).
    table = [
        (r["ops"], r["launches"], f"{r['time_us']:.1f}", _pct(r["time_us"] / total_us if total_us else None), r["name"])
        for r in rows
    ]
    return ["", title] + ["  " + l for l in _table(table, ("ops", "launches", "time us", "share", "kernel"), right=(0, 1, 2, 3))]


def format_stats(data: dict, top: int = 10) -> str:
    s = summary(data, top)
    lines = [f"neuron fusion statistics (mode: {s['mode']})", ""]
    per_launch = f" ({s['ops_per_launch']:.2f} ops per launch)" if s["ops_per_launch"] else ""
    totals = [
        ("ops recorded", s["ops_recorded"]),
        ("kernels launched", f"{s['kernels_launched']}{per_launch}"),
        ("launches saved", s["launches_saved"]),
        ("fused kernels", f"{s['fused_kernels']} launches of {s['distinct_fused_kernels']} distinct chains"),
        ("ops fused", s["ops_fused"]),
        ("device time", f"{s['device_time_us'] / 1000:.3f} ms simulated, {_pct(s['fused_time_share'])} in fused kernels"),
        ("bytes moved", _mib(s["bytes_moved"])),
        ("bytes saved", _mib(s["bytes_saved"])),
        ("errors", f"{s['errors']['deferred']} deferred, {s['errors']['raised']} raised"),
    ]
    if s["peak_memory_bytes"] is not None:
        totals.append(("peak memory", _mib(s["peak_memory_bytes"])))
    lines += [f"  {name:<18}{value}" for name, value in totals]
    lines += [""] + _wrap(device_time_note(data))
    if s["mode"] == "strict" and not s["flushes"]["total"]:
        lines += ["", "flushes: none (strict eager has no op window)"]
    else:
        lines += _explained("flushes by reason", s["flushes"]["by_reason"], "none")
    if s["top_fused_by_time"]:
        lines += _kernels(f"top fused kernels by simulated time (of {s['distinct_fused_kernels']})", s["top_fused_by_time"], s["device_time_us"])
        lines += _kernels("top fused kernels by launches", s["top_fused_by_launches"], s["device_time_us"])
    else:
        lines += ["", "fused kernels: none"]
    if s["top_single_op_by_time"]:
        lines += _kernels("top single-op kernels by simulated time", s["top_single_op_by_time"], s["device_time_us"])
    if s["patterns"]:
        rows = [(name, v.get("matched", 0), v.get("ops", 0)) for name, v in sorted(s["patterns"].items())]
        lines += ["", "patterns matched"] + ["  " + l for l in _table(rows, ("pattern", "matched", "ops"), right=(1, 2))]
    else:
        lines += ["", "patterns matched: none recorded"]
    lines += _explained("fusions refused, by reason", s["refusals"], "none", "; counted once per planned window, not per flush")
    lines += _counts("CPU fallback ops", s["fallback_ops"], "none")
    lines += ["", "caches"]
    for key, label in (("kernel_cache", "kernel cache"), ("plan_cache", "plan cache")):
        c = s["caches"][key]
        lines.append(f"  {label:<13}hit rate {_pct(c['hit_rate']):>6}  ({c['hits']} hits, {c['misses']} misses, {c.get('evictions', 0)} evictions, size {c.get('size', 0)})")
    if s["caches"]["kernel_cache"]["hits"] + s["caches"]["kernel_cache"]["misses"]:
        lines += _wrap(KERNEL_CACHE_NOTE, indent="  ")
    return "\n".join(lines)


def _wrap(text: str, indent: str = "", width: int = 92) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


_COMPARED = (
    ("ops recorded", lambda d: d["ops_recorded"]),
    ("kernels launched", lambda d: d["kernels_launched"]),
    ("fused kernels", lambda d: d["fused_kernels"]),
    ("ops fused", lambda d: d["ops_fused"]),
    ("flushes", lambda d: d["flushes"]["total"]),
    ("device time (ms)", lambda d: d["device_time_us"] / 1000),
    ("bytes moved (MiB)", lambda d: d["bytes_moved"] / (1 << 20)),
    ("bytes saved (MiB)", lambda d: d["bytes_saved"] / (1 << 20)),
    ("peak memory (MiB)", lambda d: d.get("memory", {}).get("peak_bytes", 0) / (1 << 20)),
    ("fallback ops", lambda d: sum(d["fallback_ops"].values())),
    ("fusions refused", lambda d: sum(d.get("refusals", {}).values())),
    ("kernel cache hit rate", lambda d: hit_rate(d["kernel_cache"])),
    ("plan cache hit rate", lambda d: hit_rate(d["plan_cache"])),
)


def comparison_dict(first: dict, second: dict) -> dict:
    """{row: {"first", "second", "ratio"}}; ratio is second / first, None when undefined."""
    out = {}
    for label, get in _COMPARED:
        a, b = get(first), get(second)
        out[label] = {"first": a, "second": b, "ratio": (b / a) if a and b is not None else None}
    return out


def format_comparison(first: dict, second: dict, names=("first", "second")) -> str:
    def fmt(label, value):
        if value is None:
            return "-"
        if label.endswith("hit rate"):
            return _pct(value)
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    rows = [
        (label, fmt(label, v["first"]), fmt(label, v["second"]), "-" if v["ratio"] is None else f"{v['ratio']:.3f}")
        for label, v in comparison_dict(first, second).items()
    ]
    headers = ("", f"{names[0]} ({first['mode']})", f"{names[1]} ({second['mode']})", "ratio")
    lines = _table(rows, headers, right=(1, 2, 3))
    launches = first["kernels_launched"], second["kernels_launched"]
    if all(launches):
        lines += ["", f"launches: {launches[0] / launches[1]:.2f}x fewer in the second" if launches[1] <= launches[0]
                  else f"launches: {launches[1] / launches[0]:.2f}x more in the second"]
    if first["ops_recorded"] != second["ops_recorded"]:
        lines.append("note: the two runs recorded different numbers of ops; are they the same program?")
    shares = " and ".join(f"{_pct(launch_share(d))} in {name}" for d, name in ((first, names[0]), (second, names[1])))
    lines += [""] + _wrap(
        "device time: the simulator's cost model, not hardware. Each launch costs an assumed "
        f"{launch_overhead_us(second):g} us of launch overhead (NEURON_SIM_LAUNCH_US) plus its busiest engine or "
        "its traffic; "
        f"launch overhead is {shares}.")
    if any(d["kernel_cache"]["hits"] + d["kernel_cache"]["misses"] for d in (first, second)):
        lines += _wrap("kernel cache: " + KERNEL_CACHE_NOTE)
    return "\n".join(lines)


def run_label(data: dict) -> str:
    """``strict``, ``adaptive, ours`` or ``adaptive, torchneuron`` (``adaptive`` in a dump
    that names no policy)."""
    policy = data.get("policy")
    return f"{data['mode']}, {policy}" if data["mode"] == "adaptive" and policy else data["mode"]


_RUN_ROWS = (
    ("ops recorded", lambda d: d["ops_recorded"], "{:,}"),
    ("kernels launched", lambda d: d["kernels_launched"], "{:,}"),
    ("ops per launch", lambda d: d["ops_recorded"] / d["kernels_launched"] if d["kernels_launched"] else None, "{:.2f}"),
    ("fused launches", lambda d: d["fused_kernels"], "{:,}"),
    ("flushes", lambda d: d["flushes"]["total"], "{:,}"),
    ("bytes moved (MiB)", lambda d: d["bytes_moved"] / (1 << 20), "{:,.2f}"),
    ("device time (ms)", lambda d: d["device_time_us"] / 1000, "{:,.3f}"),
    ("launch overhead share", launch_share, "pct"),
)


def format_runs(dumps: list, names: list, top: int = 5) -> str:
    """Several runs of one program side by side (``python -m adaptive_eager.compare``:
    strict eager and adaptive eager under each policy), each against the first, then each
    run's top kernels by simulated time."""
    def cell(fmt, value):
        if value is None:
            return "-"
        return _pct(value) if fmt == "pct" else fmt.format(value)

    rows = []
    for label, get, fmt in _RUN_ROWS:
        values = [get(d) for d in dumps]
        rows.append([label] + [cell(fmt, v) for v in values])
    for label, key in (("launches vs first", "kernels_launched"), ("device time vs first", "device_time_us")):
        base = dumps[0][key]
        rows.append([label] + [f"{d[key] / base:.3f}x" if base else "-" for d in dumps])
    lines = _table(rows, ("",) + tuple(names), right=tuple(range(1, len(names) + 1)))
    for data, name in zip(dumps, names):
        kernels = sorted(kernel_rows(data, True) + kernel_rows(data, False),
                         key=lambda row: (-row["time_us"], -row["launches"], row["name"]))[:top]
        lines += _kernels(f"{name}: top kernels by simulated time (of {len(data.get('kernels', {}))})", kernels,
                          data["device_time_us"])
        reasons = sorted(data["flushes"]["by_reason"].items(), key=lambda item: (-item[1], item[0]))
        if reasons:
            shown = ", ".join(f"{reason} {count}" for reason, count in reasons[:top])
            more = f", and {len(reasons) - top} more" if len(reasons) > top else ""
            lines += _wrap(f"{name}: window flushes by reason: {shown}{more}", indent="  ")
    if len({d["ops_recorded"] for d in dumps}) > 1:
        lines += ["", "note: the runs recorded different numbers of ops; are they the same program?"]
    lines += [""] + _wrap(
        "device time: the simulator's cost model (one logical NeuronCore of Trainium2, engine by engine), not "
        f"hardware; each launch adds an assumed {launch_overhead_us(dumps[-1]):g} us (NEURON_SIM_LAUNCH_US).")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m adaptive_eager.stats",
        description="Print a NEURON_FUSION_STATS dump as a table, or compare two dumps (e.g. strict.json adaptive.json).",
    )
    parser.add_argument("files", nargs="+", metavar="stats.json", help="one dump, or two to compare")
    parser.add_argument("--json", action="store_true", help="print the summary (or the comparison) as JSON")
    parser.add_argument("--top", type=int, default=10, help="how many kernels to list (default 10)")
    args = parser.parse_args(argv)
    if len(args.files) > 2:
        parser.error("give one statistics file, or two to compare")
    if args.top < 1:
        parser.error("--top must be at least 1")
    try:
        dumps = [load(path) for path in args.files]
    except StatsFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if len(dumps) == 1:
        text = json.dumps(summary(dumps[0], args.top), indent=2, sort_keys=True) if args.json else format_stats(dumps[0], args.top)
    elif args.json:
        out = {"files": args.files, "modes": [d["mode"] for d in dumps], "compared": comparison_dict(*dumps),
               "summaries": [summary(d, args.top) for d in dumps]}
        text = json.dumps(out, indent=2, sort_keys=True)
    else:
        text = format_comparison(*dumps, names=tuple(args.files))
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`
        sys.stderr.close()
    return 0
