"""The fusion report: one self-contained HTML page drawn from statistics dumps and traces.

``python -m adaptive_eager.report run.json [second.json [third.json]] [--trace trace.json ...] -o report.html``

Inline CSS and SVG only: no scripts, no fonts, no network, so the file can be mailed,
attached to a ticket or opened offline. It shows the totals; simulated device time by
fused kernel (one bar per kernel) and by single-op kernel; launches, device time and
bytes moved of the first run against the second (e.g. strict vs adaptive); flushes by reason;
why chains were not fused; CPU fallback ops; the caches; and, per ``NEURON_TRACE``
timeline, host issue vs device execution (device/hardware/trace.py: pid 1 host ops, pid 2 the
worker in real time, pid 3 the simulated device clock).

Charts carry stable ids and classes (``svg#kernel-time rect.bar`` ...) that the browser
test in tests/runtime/test_report.py counts. Entry points: :func:`render`, :func:`main`.
"""
from __future__ import annotations

import argparse
import html
import math
import os
import sys

from .report_text import (KERNEL_CACHE_NOTE, StatsFileError, device_time_note, explain, hit_rate,
                          kernel_rows, load, read_json, run_label, short_name)

TOP_FUSED = 25  # bars in the fused-kernel chart; the rest share one "others" bar
TOP_SINGLE = 12
ZOOM_KERNELS = 40
W = 1080  # width of every chart, in SVG units

CSS = """
:root{--fg:#1e293b;--mut:#64748b;--bg:#f1f5f9;--card:#fff;--line:#e2e8f0;--first:#94a3b8;--second:#2563eb;
--third:#d97706;--fused:#f97316;--single:#64748b;--flush:#8b5cf6;--host:#2563eb;--sim:#10b981}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg);margin:0}
main{max-width:1140px;margin:0 auto;padding:24px 28px 40px}
h1{font-size:22px;margin:0}h2{font-size:16px;margin:0 0 2px}.sub,.note{color:var(--mut)}.note{font-size:12.5px;margin:0 0 10px}
.headline{font-size:16px;margin:12px 0 16px}.headline b{color:var(--second)}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(165px,1fr));gap:10px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:10px 14px}
.card .k{color:var(--mut);font-size:11.5px;text-transform:uppercase;letter-spacing:.04em}.card .v{font-size:21px;font-weight:600}
.card .d{color:var(--mut);font-size:12px}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:14px 18px;margin-top:16px}
svg{display:block;max-width:100%;height:auto;margin-top:6px}svg text{font-size:12px;fill:var(--fg)}svg text.dim{fill:var(--mut)}
svg text.mono{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-size:11.5px}
.bar.fused,.kernel.fused{fill:var(--fused)}.bar.single,.kernel.single{fill:var(--single)}.bar.others{fill:#fdba74}
.bar.first{fill:var(--first)}.bar.second{fill:var(--second)}.bar.third{fill:var(--third)}.bar.flush{fill:var(--flush)}
.busy.host,.op{fill:var(--host)}.busy.fused{fill:var(--fused)}.busy.single{fill:var(--single)}.l1{opacity:.3}.l2{opacity:.5}.l3{opacity:.75}.lane-bg{fill:#f8fafc;stroke:var(--line)}
.flow{stroke:#94a3b8;stroke-width:.6;opacity:.7}.axis{stroke:#cbd5e1}
table{border-collapse:collapse;width:100%;margin-top:6px}th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line)}
th{color:var(--mut);font-weight:600;font-size:12px}td.n{text-align:right;font-variant-numeric:tabular-nums}code{font-size:12.5px}
.meter{background:var(--line);border-radius:3px;height:10px;width:160px;display:inline-block;vertical-align:middle;margin-right:8px}
.meter i{display:block;height:100%;background:var(--sim);border-radius:3px}
.legend{font-size:12px;color:var(--mut)}.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 12px}
.empty{color:var(--mut);font-style:italic}
"""

def esc(value) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:,.2f}"


def _ms(us: float) -> str:
    return f"{us / 1000:,.2f} ms" if us >= 100 else f"{us:,.1f} µs"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _times(a: float, b: float, less: str = "less") -> str:
    if not a or not b:
        return ""
    return f"{a / b:.2f}× {less}" if b < a else f"{b / a:.2f}× more" if b > a else "same"


# -- charts ---------------------------------------------------------------------------------
def _svg(svg_id: str, height: float, cls: str = "chart") -> str:
    return f'<svg id="{svg_id}" class="{cls}" viewBox="0 0 {W} {height}" width="{W}" height="{height}">'


def _bar(x: float, y: float, width: float, height: float, cls: str, tip: str, text: str, label: str = "", mono: bool = False) -> str:
    """One bar in a <g> with its tooltip, an optional label left of ``x`` and a value text after the bar."""
    label = f'<text class="{"mono" if mono else ""}" x="{x - 8}" y="{y + height - 3}" text-anchor="end">{esc(label)}</text>' if label else ""
    return (f'<g><title>{esc(tip)}</title>{label}<rect class="bar {cls}" x="{x}" y="{y}" width="{max(width, 1.5):.1f}" '
            f'height="{height}" rx="2"/><text class="dim" x="{x + width + 6:.1f}" y="{y + height - 3}">{esc(text)}</text></g>')


def hbars(svg_id: str, rows: list, label_w: int = 400, text_w: int = 230, mono: bool = True) -> str:
    """Horizontal bars; ``rows``: (label, value, value text, tooltip, css class)."""
    vmax = max((r[1] for r in rows), default=0) or 1
    out = [_svg(svg_id, len(rows) * 22 + 6)]
    out += [_bar(label_w, 6 + i * 22, value / vmax * (W - label_w - text_w), 15, cls, tip, text, label, mono)
            for i, (label, value, text, tip, cls) in enumerate(rows)]
    return "\n".join(out) + "</svg>"


_RUN_CLASSES = ("first", "second", "third")


def compare_bars(dumps: list, names) -> str:
    """Launches, device time and bytes moved of two or three runs: one bar each, every
    later run's with its ratio to the first."""
    metrics = (
        ("kernel launches", "kernels_launched", _num),
        ("simulated device time", "device_time_us", _ms),
        ("bytes moved", "bytes_moved", _mib),
    )
    label_w, bars_w, step = 200, W - 430, 20 * len(dumps) + 14
    out = [_svg("compare", len(metrics) * step)]
    for i, (label, key, fmt) in enumerate(metrics):
        values = [d[key] for d in dumps]
        top, vmax = i * step, max(values) or 1
        out.append(f'<text x="{label_w - 10}" y="{top + 10 * len(dumps) + 4}" text-anchor="end">{esc(label)}</text>')
        for j, (value, name) in enumerate(zip(values, names)):
            ratio = _times(values[0], value, "fewer" if i == 0 else "less") if j else ""
            out.append(_bar(label_w, top + 2 + 20 * j, value / vmax * bars_w, 16, _RUN_CLASSES[j], f"{name}: {fmt(value)}",
                            f"{fmt(value)}   {ratio}".rstrip()))
    return "\n".join(out) + "</svg>"


def _ticks(span: float, pixels: float, x0: float, y: float) -> str:
    """Axis ticks for ``span`` microseconds drawn over ``pixels``, labelled in ms."""
    if span <= 0:
        return ""
    raw = span / 7
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    out, t = [], 0.0
    while t <= span + 1e-9:
        x = x0 + t / span * pixels
        label = f"{t / 1000:g} ms" if step >= 100 else f"{t:g} µs"
        out.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{y}"/>')
        if x < x0 + pixels - 25 or t == 0:  # no label cut off at the right edge
            out.append(f'<text class="dim" x="{x:.1f}" y="{y + 13}" text-anchor="middle">{label}</text>')
        t += step
    return "".join(out)


def load_trace(path: str) -> dict:
    trace = read_json(path, "JSON trace")
    if isinstance(trace, dict) and "version" in trace and "traceEvents" not in trace:
        raise StatsFileError(f"{path}: a statistics dump, not a NEURON_TRACE timeline (give it without --trace)")
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise StatsFileError(f'{path}: not a Chrome trace (no "traceEvents" list)')
    return trace


def trace_tracks(trace: dict) -> tuple[dict, dict, dict, dict]:
    """(tracks, names, flows, ops): tracks maps (pid, tid) to [(start, end, name, args)] of
    complete ("X") events; flows maps (tid, ts) of a worker kernel to the op ids it ran;
    ops maps an op id to its host slice."""
    tracks, names, flows, ops = {}, {}, {}, {}
    for e in trace["traceEvents"]:
        if not isinstance(e, dict):
            continue
        ph, key = e.get("ph"), (e.get("pid"), e.get("tid"))
        if ph == "M" and isinstance(e.get("args"), dict):
            names[(e.get("pid"), e.get("tid")) if e.get("name") == "thread_name" else (e.get("pid"), None)] = str(e["args"].get("name", ""))
        elif ph == "X" and isinstance(e.get("ts"), (int, float)):
            start = float(e["ts"])
            item = (start, start + float(e.get("dur") or 0), str(e.get("name", "")), e.get("args") or {})
            tracks.setdefault(key, []).append(item)
            if key[0] == 1 and "op_id" in item[3]:
                ops[item[3]["op_id"]] = (key[1], item)
        elif ph == "f" and e.get("pid") == 2:
            flows.setdefault((e.get("tid"), e.get("ts")), []).append(e.get("id"))
    for items in tracks.values():
        items.sort(key=lambda item: item[0])
    return tracks, names, flows, ops


def _lane_label(key, names) -> str:
    pid, tid = key
    thread = names.get(key) or f"thread {tid}"
    return {1: f"host · {thread}", 2: f"device worker · {thread}", 3: f"simulated device · {thread}"}.get(pid, f"pid {pid} · {thread}")


def _binned(items, t0: float, span: float, bins: int, base: str) -> list:
    """A lane as runs of pixel columns: [first, last, css class, busy level 1-4]. A column
    is coloured by what ran most of its busy time (fused or single-op kernels), and is
    darker the larger the share of it spent busy."""
    busy, fused = [0.0] * bins, [0.0] * bins
    width = span / bins
    for start, end, _, args in items:
        s = (start - t0) / width
        e = max((end - t0) / width, s + 1e-6)
        is_fused = args.get("ops", 1) > 1
        for i in range(max(int(s), 0), min(int(e), bins - 1) + 1):
            part = min(e, i + 1) - max(s, i)
            busy[i] += part
            fused[i] += part if is_fused else 0.0
    runs: list = []
    for i in range(bins):
        if busy[i] <= 0:
            continue
        level = min(4, max(1, math.ceil(busy[i] * 4 - 1e-9)))
        cls = base if base == "host" else "fused" if fused[i] * 2 > busy[i] else "single"
        if runs and runs[-1][1] == i - 1 and runs[-1][2:] == [cls, level]:
            runs[-1][1] = i
        else:
            runs.append([i, i, cls, level])
    return runs


def timeline(trace: dict, title: str, index: int) -> str:
    tracks, names, flows, ops = trace_tracks(trace)
    real = sorted((k for k in tracks if k[0] in (1, 2)), key=lambda k: (k[0], tracks[k][0][0]))
    sim = sorted(k for k in tracks if k[0] == 3)
    if not real and not sim:
        return f'<section><h2>Timeline: {esc(title)}</h2><p class="empty">The trace has no slices.</p></section>'
    label_w, lane_h, bins = 230, 34, 840
    parts = [f'<section class="timeline"><h2>Timeline: {esc(title)}</h2><p class="note">The whole run. Top: real time, the '
             f'host threads issuing ops and the device worker running kernels. Bottom: the simulator\'s device clock, a '
             f'separate time base that starts at 0. Each pixel column shows what ran in it, paler when mostly idle:'
             f'<span class="legend"><i style="background:var(--host)"></i>host op<i style="background:var(--fused)"></i>fused '
             f'kernel<i style="background:var(--single)"></i>single-op kernel</span></p>']
    for panel, keys in (("real", real), ("sim", sim)):
        if not keys:
            continue
        t0 = min(tracks[k][0][0] for k in keys)
        span = max(max(i[1] for i in tracks[k]) for k in keys) - t0 or 1.0
        px = (W - label_w - 10) / bins
        height = len(keys) * lane_h + 22
        parts.append(_svg(f"timeline-{index}-{panel}", height, "chart overview"))
        for row, key in enumerate(keys):
            items, y = tracks[key], row * lane_h
            busy = sum(i[1] - i[0] for i in items) / span
            parts.append(f'<g class="lane" data-pid="{key[0]}" data-tid="{esc(key[1])}"><text x="{label_w - 8}" y="{y + 14}" text-anchor="end">'
                         f'{esc(_lane_label(key, names))}</text><text class="dim" x="{label_w - 8}" y="{y + 28}" text-anchor="end">'
                         f'{len(items):,} slices · busy {busy:.0%}</text><rect class="lane-bg" x="{label_w}" y="{y + 4}" '
                         f'width="{bins * px:.1f}" height="{lane_h - 8}"/>')
            parts += [f'<rect class="busy {cls} l{level}" x="{label_w + first * px:.1f}" y="{y + 5}" width="{(last - first + 1) * px:.1f}" '
                      f'height="{lane_h - 10}"/>' for first, last, cls, level in _binned(items, t0, span, bins, "host" if key[0] == 1 else "kernel")]
            parts.append("</g>")
        parts.append(_ticks(span, bins * px, label_w, len(keys) * lane_h + 2) + "</svg>")
    parts.append(_zoom(tracks, names, flows, ops, index))
    return "\n".join(parts) + "</section>"


def _zoom(tracks, names, flows, ops, index: int) -> str:
    """A few consecutive kernels from the middle of the run, each joined to its ops' issue."""
    workers = [k for k in tracks if k[0] == 2]
    if not workers:
        return ""
    stream = max(workers, key=lambda k: len(tracks[k]))
    kernels = tracks[stream]
    first = max(0, len(kernels) // 2 - ZOOM_KERNELS // 2)
    chosen = kernels[first:first + ZOOM_KERNELS]
    issued = [(ops[i], k) for k in chosen for i in flows.get((stream[1], k[0]), ()) if i in ops]
    k0, t1 = chosen[0][0], max(k[1] for k in chosen)
    t0 = max(min([k0] + [op[1][0] for op, _ in issued]), k0 - 1.5 * (t1 - k0))  # ops issued long before: clipped
    lags = sorted(k[0] - op[1][0] for op, k in issued)
    lag = f" Median wait from issue to execution: {_ms(lags[len(lags) // 2])}." if lags else ""
    hosts = sorted({op[0] for op, _ in issued} or {k[1] for k in tracks if k[0] == 1}, key=str)
    label_w, lane_h, pixels = 230, 30, W - 240
    scale, x0 = pixels / ((t1 - t0) or 1.0), float(label_w)
    height = (len(hosts) + 1) * (lane_h + 16) + 22
    out = [f'<p class="note" style="margin-top:14px">Zoom: {len(chosen)} consecutive kernels from the middle of the run; each '
           f'line joins an op\'s issue on the host to the kernel that ran it (a line from the left edge: issued earlier).{lag}</p>'
           + _svg(f"timeline-{index}-zoom", height, "chart zoom")]
    lane_y = {tid: row * (lane_h + 16) for row, tid in enumerate(hosts)}
    wy = len(hosts) * (lane_h + 16)
    for tid, y in lane_y.items():
        visible = [i for i in tracks.get((1, tid), ()) if i[1] >= t0 and i[0] <= t1]
        out.append(f'<g class="lane" data-pid="1"><text x="{label_w - 8}" y="{y + 19}" text-anchor="end">{esc(_lane_label((1, tid), names))}</text>'
                   f'<rect class="lane-bg" x="{x0}" y="{y}" width="{pixels}" height="{lane_h}"/>')
        for start, end, name, _ in visible[:600]:
            a, b = x0 + max(start - t0, 0) * scale, x0 + (min(end, t1) - t0) * scale
            out.append(f'<rect class="op" x="{a:.1f}" y="{y + 2}" width="{max(b - a, 0.8):.1f}" height="{lane_h - 4}"><title>{esc(name)}</title></rect>')
        out.append("</g>")
    out.append(f'<g class="lane" data-pid="2"><text x="{label_w - 8}" y="{wy + 19}" text-anchor="end">{esc(_lane_label(stream, names))}</text>'
               f'<rect class="lane-bg" x="{x0}" y="{wy}" width="{pixels}" height="{lane_h}"/>')
    for (tid, (start, _, _, _)), k in issued[:400]:
        out.append(f'<line class="flow" x1="{x0 + max(start - t0, 0) * scale:.1f}" y1="{lane_y[tid] + lane_h}" '
                   f'x2="{x0 + (k[0] - t0) * scale:.1f}" y2="{wy}"/>')
    for start, end, name, args in chosen:
        cls = "fused" if args.get("ops", 1) > 1 else "single"
        out.append(f'<rect class="kernel {cls}" x="{x0 + (start - t0) * scale:.1f}" y="{wy + 2}" width="{max((end - start) * scale, 1.0):.1f}" '
                   f'height="{lane_h - 4}"><title>{esc(name)} ({args.get("ops", 1)} ops, {end - start:.1f} µs real)</title></rect>')
    out.append("</g>" + _ticks(t1 - t0, pixels, x0, wy + lane_h + 4) + "</svg>")
    return "\n".join(out)


# -- the page -------------------------------------------------------------------------------
def _cards(dumps: list) -> str:
    rows = (
        ("ops recorded", lambda d: d["ops_recorded"], _num),
        ("kernel launches", lambda d: d["kernels_launched"], _num),
        ("launches saved", lambda d: d["ops_recorded"] - d["kernels_launched"], _num),
        ("fused launches", lambda d: d["fused_kernels"], _num),
        ("simulated device time", lambda d: d["device_time_us"], _ms),
        ("bytes moved", lambda d: d["bytes_moved"], _mib),
        ("bytes saved", lambda d: d["bytes_saved"], _mib),
        ("CPU fallback ops", lambda d: sum(d["fallback_ops"].values()), _num),
        ("deferred errors", lambda d: d["errors"]["deferred"], _num),
        ("kernel cache hits", lambda d: hit_rate(d["kernel_cache"]), _pct),
        ("plan cache hits", lambda d: hit_rate(d["plan_cache"]), _pct),
    )
    cards = []
    for key, get, fmt in rows:
        a, b = get(dumps[0]), get(dumps[-1])
        ratio = "" if fmt is _pct else _times(a, b, "less" if fmt in (_ms, _mib) else "fewer")
        detail = "" if len(dumps) == 1 else " → ".join(fmt(get(d)) for d in dumps) + (f" · {ratio}" if ratio else "")
        cards.append(f'<div class="card"><div class="k">{esc(key)}</div><div class="v">{esc(fmt(b))}</div><div class="d">{esc(detail)}</div></div>')
    return '<div class="cards">' + "".join(cards) + "</div>"


def _headline(dumps: list) -> str:
    d = dumps[-1]
    if len(dumps) > 2:
        first = dumps[0]
        runs = "; ".join(f'{esc(run_label(x))}: <b>{_num(x["kernels_launched"])}</b> launches, {_ms(x["device_time_us"])}'
                         + (f' ({esc(_times(first["kernels_launched"], x["kernels_launched"], "fewer") or "the same")})' if i else "")
                         for i, x in enumerate(dumps))
        return f'{_num(first["ops_recorded"])} ops, run {len(dumps)} ways. {runs}.'
    if len(dumps) == 2:
        a = dumps[0]
        return (f'The second run ({esc(d["mode"])}) issued <b>{_num(d["kernels_launched"])}</b> launches for '
                f'{_num(d["ops_recorded"])} ops, against {_num(a["kernels_launched"])} in the first ({esc(a["mode"])}): '
                f'<b>{esc(_times(a["kernels_launched"], d["kernels_launched"], "fewer") or "the same")}</b>. Simulated device time '
                f'{_ms(a["device_time_us"])} → <b>{_ms(d["device_time_us"])}</b>.')
    return (f'{_num(d["ops_recorded"])} ops ran as <b>{_num(d["kernels_launched"])}</b> kernel launches '
            f'({_num(d["fused_kernels"])} of them fused) in <b>{_ms(d["device_time_us"])}</b> of simulated device time.')


def _kernel_sections(d: dict, name: str, suffix: str = "") -> str:
    total = d["device_time_us"] or 1
    fused = kernel_rows(d, fused=True)
    out = [f'<section><h2>Simulated device time by fused kernel</h2><p class="note">{esc(name)}: '
           f'{len(fused)} distinct fused kernels, {_pct(sum(r["time_us"] for r in fused) / total)} of device time. '
           f'One bar per kernel, longest first, labelled with its first ops (the whole chains are listed below the chart; '
           f'hover for one). Names: <code>a|b|c</code> one fused chain, '
           f'<code>chain x4</code> four copies of it in one launch, <code>silu(chain)</code> a library pattern\'s kernel.</p>']
    if d["patterns"]:
        out.append('<p class="note">Library patterns matched: ' + ", ".join(
            f'<b>{esc(n)}</b> {v.get("matched", 0):,}× ({v.get("ops", 0):,} ops)' for n, v in sorted(d["patterns"].items())) + "</p>")
    if fused:
        rows = [(f'#{i} {short_name(r["name"], 48)}', r["time_us"], f'{_ms(r["time_us"])} · {r["launches"]:,}× · {r["ops"]} ops',
                 f'{r["name"]}\n{r["launches"]:,} launches, {r["time_us"]:.1f} µs, {r["bytes"]:,} bytes', "fused")
                for i, r in enumerate(fused[:TOP_FUSED], 1)]
        rest = fused[TOP_FUSED:]
        if rest:
            rows.append((f"{len(rest)} other fused kernels", sum(r["time_us"] for r in rest),
                         _ms(sum(r["time_us"] for r in rest)), ", ".join(r["name"] for r in rest)[:2000], "others"))
        out.append(hbars("kernel-time" + suffix, rows))
        chains = "".join(f'<tr><td class=n>#{i}</td><td><code>{"|<wbr>".join(esc(op) for op in r["name"].split("|"))}</code></td></tr>'
                         for i, r in enumerate(fused[:TOP_FUSED], 1))
        out.append(f'<details><summary class="note">The {min(len(fused), TOP_FUSED)} chains in full</summary>'
                   f'<table id="chains{suffix}">{chains}</table></details>')
    else:
        out.append(f'<p class="empty">No fused kernels: this run was in {esc(d["mode"])} eager.</p>')
    single = kernel_rows(d, fused=False)[:TOP_SINGLE]
    if single:
        out.append('<h2 style="margin-top:14px">Single-op kernels by simulated device time</h2>')
        out.append(hbars("single-time" + suffix, [(r["name"], r["time_us"], f'{_ms(r["time_us"])} · {r["launches"]:,}×',
                                          f'{r["name"]}: {r["launches"]:,} launches', "single") for r in single]))
    return "\n".join(out) + "</section>"


def _flush_section(d: dict, name: str = "", suffix: str = "") -> str:
    reasons = sorted(d["flushes"]["by_reason"].items(), key=lambda x: (-x[1], x[0]))
    body = hbars("flushes" + suffix, [(r, n, f"{n:,} · {explain(r)}", f"{r}: {n} flushes", "flush") for r, n in reasons], label_w=240, text_w=420, mono=False) \
        if reasons else f'<p class="empty">No flushes: {"strict eager has no op window" if d["mode"] == "strict" else "nothing was buffered"}.</p>'
    of = f"{esc(name)}: " if suffix or name else ""
    return f'<section><h2>Why the window was flushed</h2><p class="note">{of}{d["flushes"]["total"]:,} flushes in all.</p>{body}</section>'


def _refusal_section(d: dict, suffix: str = "") -> str:
    refusals = sorted(d.get("refusals", {}).items(), key=lambda x: (-x[1], x[0]))
    rows = "".join(f"<tr><td><code>{esc(r)}</code></td><td class=n>{n:,}</td><td>{esc(explain(r))}</td></tr>" for r, n in refusals)
    body = f'<table id="refusals{suffix}"><tr><th>reason</th><th>times</th><th>what it means</th></tr>{rows}</table>' if refusals \
        else '<p class="empty">No fusion was refused.</p>'
    return ('<section><h2>Why not fused</h2><p class="note">Each time the planner declined to merge a producer into its consumer. '
            'Counted once per planned window: windows served from the plan cache are not counted again. '
            f'<code>NEURON_LOG_LEVEL=DEBUG</code> logs each one with its ops.</p>{body}</section>')


def _fallback_and_caches(dumps: list, names) -> str:
    ops = sorted({op for d in dumps for op in d["fallback_ops"]})
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    rows = "".join(f"<tr><td><code>{esc(op)}</code></td>" + "".join(f"<td class=n>{d['fallback_ops'].get(op, 0):,}</td>" for d in dumps) + "</tr>" for op in ops)
    fallback = f'<table id="fallback"><tr><th>op</th>{head}</tr>{rows}</table>' if ops else '<p class="empty">None: every op ran on the device.</p>'
    caches = ""
    for d, name in zip(dumps, names):
        for key in ("kernel_cache", "plan_cache"):
            c, rate = d[key], hit_rate(d[key])
            if rate is None:
                continue
            meter = f'<span class="meter"><i style="width:{100 * (rate or 0):.1f}%"></i></span>{_pct(rate)}'
            caches += (f"<tr><td>{esc(name)}</td><td>{key.replace('_', ' ')}</td><td>{meter}</td><td class=n>{c['hits']:,}</td>"
                       f"<td class=n>{c['misses']:,}</td><td class=n>{c.get('evictions', 0):,}</td><td class=n>{c.get('size', 0):,}</td></tr>")
    caches = caches or '<tr><td colspan=7 class="empty">No cache lookups: caches are used by adaptive eager only.</td></tr>'
    return (f'<section><h2>CPU fallback ops</h2><p class="note">Ops the device lacks run on the CPU after a sync point.</p>{fallback}</section>'
            f'<section><h2>Caches</h2><p class="note">{esc(KERNEL_CACHE_NOTE)}</p><table id="caches"><tr><th>run</th><th>cache</th><th>hit rate</th><th>hits</th><th>misses</th>'
            f'<th>evictions</th><th>size</th></tr>{caches}</table></section>')


def render(dumps: list, names: list, traces: list = (), trace_names: list = ()) -> str:
    """The report page for one to three statistics dicts (e.g. strict, adaptive under our
    policy, adaptive under TorchNeuron's: ``python -m adaptive_eager.compare``) and any
    number of traces. The kernels, flushes and refusals are shown for the last adaptive
    run, and, with three runs, for every adaptive run."""
    focus = next((i for i in range(len(dumps) - 1, -1, -1) if dumps[i]["mode"] == "adaptive"), len(dumps) - 1)
    labels = [f"{os.path.basename(n)} ({run_label(d)})" for n, d in zip(names, dumps)]
    parts = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>neuron fusion report</title>'
             f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style></head><body><main>'
             f'<h1>neuron fusion report</h1><div class="sub">{esc(" vs ".join(labels))} · '
             f'{esc(dumps[focus].get("device", {}).get("name", "neuron"))}</div>',
             f'<p class="headline">{_headline(dumps)}</p>', _cards(dumps),
             f'<p class="note" id="device-time-note" style="margin-top:10px">{esc(device_time_note(dumps[focus]))}</p>']
    if len(dumps) >= 2:
        legend = "".join(f'<i style="background:var(--{_RUN_CLASSES[i]})"></i>{esc(label)}' for i, label in enumerate(labels))
        parts.append(f'<section><h2>{" vs ".join(esc(label) for label in labels)}</h2><p class="note"><span class="legend">'
                     f'{legend}</span></p>{compare_bars(dumps, labels)}</section>')
    others = [i for i, d in enumerate(dumps) if d["mode"] == "adaptive" and i != focus] if len(dumps) > 2 else []
    for i in others:
        suffix = f"-{i}"
        parts += [_kernel_sections(dumps[i], labels[i], suffix), _flush_section(dumps[i], labels[i], suffix),
                  _refusal_section(dumps[i], suffix)]
    parts += [_kernel_sections(dumps[focus], labels[focus]), _flush_section(dumps[focus], labels[focus] if others else ""),
              _refusal_section(dumps[focus]), _fallback_and_caches(dumps, labels)]
    paired = len(traces) == len(dumps)  # --trace given once per dump, in the same order
    parts += [timeline(t, f"{labels[i]}, {os.path.basename(n)}" if paired else os.path.basename(n), i)
              for i, (t, n) in enumerate(zip(traces, trace_names))]
    parts.append('<p class="note" style="margin-top:16px">Generated by <code>python -m adaptive_eager.report</code>. '
                 'Device times come from the simulator\'s cost model, not from hardware.</p></main></body></html>')
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_eager.report",
                                     description="Write a self-contained HTML fusion report from NEURON_FUSION_STATS dumps.")
    parser.add_argument("files", nargs="+", metavar="stats.json",
                        help="one dump, or two or three to compare (e.g. strict.json adaptive.json)")
    parser.add_argument("--trace", action="append", default=[], metavar="trace.json", help="a NEURON_TRACE file (repeatable)")
    parser.add_argument("-o", "--output", default="report.html", help="where to write the page (default report.html)")
    args = parser.parse_args(argv)
    if len(args.files) > 3:
        parser.error("give one statistics file, or two or three to compare")
    try:
        dumps = [load(path) for path in args.files]
        traces = [load_trace(path) for path in args.trace]
    except StatsFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    page = render(dumps, args.files, traces, args.trace)
    try:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(page)
    except OSError as error:
        print(f"error: {args.output}: cannot write ({error.strerror})", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(page) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
