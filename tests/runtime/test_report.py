"""The HTML fusion report (python -m adaptive_eager.report): its content, checked on the
generated file and again in a real browser (headless Chromium: the DOM it built, and a
screenshot), on real dumps and traces from a strict and an adaptive run of one loop."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest

from adaptive_eager import report
from adaptive_eager.report_text import load
from test_stats_cli import make_runs, ops_in

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run")
FUSED_RGB, SECOND_RGB = (0xF9, 0x73, 0x16), (0x25, 0x63, 0xEB)  # --fused, --second in report.CSS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return make_runs(tmp_path_factory.getbasetemp() / "training_runs")


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory):
    """The report of both runs with both traces, written by the CLI."""
    path = tmp_path_factory.mktemp("report") / "report.html"
    code = report.main([str(runs["strict"]), str(runs["adaptive"]), "--trace", str(runs["strict_trace"]),
                        "--trace", str(runs["adaptive_trace"]), "-o", str(path)])
    assert code == 0
    return path


# -- a small DOM ---------------------------------------------------------------------------
class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, dict(attrs), parent, [], ""

    @property
    def classes(self):
        return set((self.attrs.get("class") or "").split())

    def iter(self):
        for child in self.children:
            yield child
            yield from child.iter()

    def find_all(self, tag, *classes):
        return [n for n in self.iter() if n.tag == tag and set(classes) <= n.classes]

    def by_id(self, ident):
        return next((n for n in self.iter() if n.attrs.get("id") == ident), None)

    def title(self):
        return "".join(c.text for c in self.children if c.tag == "title")


class _Builder(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "wbr", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.node = Node("#document", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.node)
        self.node.children.append(node)
        if tag not in self.VOID:
            self.node = node

    def handle_startendtag(self, tag, attrs):  # <rect .../> in the generated file
        self.node.children.append(Node(tag, attrs, self.node))

    def handle_endtag(self, tag):
        node = self.node
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.node = node.parent

    def handle_data(self, data):
        self.node.text += data


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    return builder.root


def text_of(node: Node) -> str:
    return node.text + "".join(text_of(child) for child in node.children)


# -- what the page must show, from the inputs --------------------------------------------------
def expected_tracks(trace_path):
    events = json.loads(trace_path.read_text())["traceEvents"]
    tracks = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    return tracks


def check_page(root: Node, strict: dict, adaptive: dict, traces) -> None:
    # one bar per fused kernel of the adaptive run, longest first, each titled with its chain
    fused = sorted(((k["time_us"], n) for n, k in adaptive["kernels"].items() if ops_in(n) > 1), key=lambda x: (-x[0], x[1]))
    bars = root.by_id("kernel-time").find_all("rect", "bar")
    assert len(bars) == min(len(fused), report.TOP_FUSED) + (len(fused) > report.TOP_FUSED) and len(bars) >= 3
    assert [b.parent.title().split("\n")[0] for b in bars[:report.TOP_FUSED]] == [n for _, n in fused[:report.TOP_FUSED]]
    # labels: rank and the chain's first ops (cut at the end, never in the middle); the
    # whole chains are listed under the chart
    labels = [text_of(b.parent.find_all("text")[0]) for b in bars[:report.TOP_FUSED]]
    for rank, (label, (_, name)) in enumerate(zip(labels, fused), 1):
        head = label.split(" ", 1)[1].split("|…")[0]
        assert label.startswith(f"#{rank} ") and name.startswith(head) and " ... " not in label
    chains = [text_of(r.find_all("td")[1]) for r in root.by_id("chains").find_all("tr")]
    assert chains == [n for _, n in fused[:report.TOP_FUSED]]
    # what simulated device time is, and why the kernel cache rarely hits
    note = " ".join(text_of(root.by_id("device-time-note")).split())
    launches, overhead = adaptive["kernels_launched"], adaptive["device"]["launch_overhead_us"]
    assert "NEURON_SIM_LAUNCH_US" in note and f"{launches} launches x {overhead:g} us" in note
    assert "a plan-cache hit reuses the plan's kernels and skips it" in text_of(root)
    widths = [float(b.attrs["width"]) for b in bars[:report.TOP_FUSED]]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    singles = [n for n in adaptive["kernels"] if ops_in(n) == 1]
    assert len(root.by_id("single-time").find_all("rect", "bar", "single")) == min(len(singles), report.TOP_SINGLE)
    # strict vs adaptive: two bars per compared figure
    compare = root.by_id("compare")
    assert len(compare.find_all("rect", "bar", "first")) == len(compare.find_all("rect", "bar", "second")) == 3
    launches = compare.find_all("rect", "bar")[:2]
    ratio = float(launches[1].attrs["width"]) / float(launches[0].attrs["width"])
    assert ratio == pytest.approx(adaptive["kernels_launched"] / strict["kernels_launched"], rel=0.01)
    # flushes by reason, why-not-fused, fallback
    flushes = root.by_id("flushes").find_all("rect", "bar", "flush")
    assert sorted(b.parent.title() for b in flushes) == sorted(f"{r}: {n} flushes" for r, n in adaptive["flushes"]["by_reason"].items())
    refusal_rows = root.by_id("refusals").find_all("tr")[1:]
    assert {text_of(r.find_all("td")[0]): text_of(r.find_all("td")[1]) for r in refusal_rows} == {
        reason: f"{n:,}" for reason, n in adaptive["refusals"].items()}
    fallback_rows = root.by_id("fallback").find_all("tr")[1:]
    assert [[text_of(td) for td in r.find_all("td")] for r in fallback_rows] == [["aten::geqrf", "1", "1"]]
    # one timeline per trace: a lane per host thread and worker stream, then the simulated clock
    for index, trace_path in enumerate(traces):
        tracks = expected_tracks(trace_path)
        real = root.by_id(f"timeline-{index}-real").find_all("g", "lane")
        assert sorted((int(g.attrs["data-pid"]), g.attrs["data-tid"]) for g in real) == sorted(
            (pid, str(tid)) for pid, tid in tracks if pid in (1, 2))
        assert all(g.find_all("rect", "busy") for g in real)
        # host lanes are named by thread: the training loop's, and autograd's engine thread
        # (a thread Python did not start, which Python calls "Dummy-1")
        host_lanes = [text_of(g.find_all("text")[0]) for g in real if g.attrs["data-pid"] == "1"]
        assert "host · MainThread" in host_lanes and "host · autograd" in host_lanes, host_lanes
        assert not any("Dummy" in lane for lane in host_lanes)
        assert len(root.by_id(f"timeline-{index}-sim").find_all("g", "lane")) == len([k for k in tracks if k[0] == 3])
        zoom = root.by_id(f"timeline-{index}-zoom")
        kernels = zoom.find_all("rect", "kernel")
        worker = max((k for k in tracks if k[0] == 2), key=lambda k: len(tracks[k]))
        assert len(kernels) == min(report.ZOOM_KERNELS, len(tracks[worker]))
        names = {e["name"] for e in tracks[worker]}
        assert all(k.title().rsplit(" (", 1)[0] in names for k in kernels)
        ops = [int(re.search(r"\((\d+) ops, ", k.title()).group(1)) for k in kernels]
        assert [("fused" in k.classes) for k in kernels] == [n > 1 for n in ops]
        assert zoom.find_all("line", "flow")


def test_report_content(runs, page):
    html = page.read_text()
    check_page(parse(html), load(runs["strict"]), load(runs["adaptive"]), [runs["strict_trace"], runs["adaptive_trace"]])
    # self-contained: no scripts, no links, nothing fetched
    lowered = html.lower()
    for needle in ("<script", "<link", "src=", "href=", "@import", "url(", "http://", "https://"):
        assert needle not in lowered, needle
    assert 20_000 < len(html) < 1_000_000


def test_single_strict_dump(runs, tmp_path):
    out = tmp_path / "strict.html"
    assert report.main([str(runs["strict"]), "-o", str(out)]) == 0
    root = parse(out.read_text())
    assert root.by_id("kernel-time") is None and root.by_id("compare") is None and root.by_id("flushes") is None
    text = text_of(root)
    assert "No fused kernels: this run was in strict eager." in text
    assert "No flushes: strict eager has no op window." in text
    strict = load(runs["strict"])
    bars = root.by_id("single-time").find_all("rect", "bar")
    top = max(strict["kernels"].items(), key=lambda item: item[1]["time_us"])[0]
    assert len(bars) == report.TOP_SINGLE and bars[0].parent.title().startswith(f"{top}:")


def test_many_kernels_and_hostile_names(runs):
    data = load(runs["adaptive"])
    kernels = {f"mul|add{i}|relu": {"launches": i + 1, "time_us": 10.0 * (i + 1), "bytes": 64} for i in range(30)}
    kernels['<img src=x onerror="alert(1)">|relu'] = {"launches": 1, "time_us": 1000.0, "bytes": 8}
    html = report.render([dict(data, kernels=kernels)], ["a<b>.json"])
    root = parse(html)
    bars = root.by_id("kernel-time").find_all("rect", "bar")
    assert len(bars) == report.TOP_FUSED + 1 and "others" in bars[-1].classes
    assert text_of(bars[-1].parent.find_all("text")[0]) == f"{31 - report.TOP_FUSED} other fused kernels"
    assert bars[0].parent.title().startswith('<img src=x onerror="alert(1)">|relu')  # as text, not markup
    assert "<img" not in html and "&lt;img" in html and root.find_all("img") == []


@pytest.mark.parametrize("case", ["missing stats", "trace as stats", "stats as trace", "bad trace", "unwritable"])
def test_report_errors(case, runs, tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"traceEvents": 3}')
    argv, message = {
        "missing stats": ([tmp_path / "no.json"], "no such file"),
        "trace as stats": ([runs["strict_trace"]], "a NEURON_TRACE timeline, not a NEURON_FUSION_STATS dump"),
        "stats as trace": ([runs["strict"], "--trace", runs["adaptive"]], "a statistics dump, not a NEURON_TRACE timeline"),
        "bad trace": ([runs["strict"], "--trace", tmp_path / "bad.json"], 'not a Chrome trace (no "traceEvents" list)'),
        "unwritable": ([runs["strict"], "-o", tmp_path / "no" / "dir" / "r.html"], "cannot write"),
    }[case]
    assert report.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


# -- in a real browser ---------------------------------------------------------------------
def chromium():
    """The Chromium binary, or skip (only) where it cannot run."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("headless Chromium not installed: `apt-get install -y chromium` (Debian), as .ci/run does where apt works")
    try:
        probe = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as error:
        pytest.skip(f"Chromium at {binary} cannot be run here: {error}")
    if probe.returncode != 0:
        pytest.skip(f"Chromium at {binary} cannot be run here: {probe.stderr.strip()[-300:]}")
    return binary


def browse(binary, tmp_path, page, *args) -> subprocess.CompletedProcess:
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args, page.as_uri()]
    result = subprocess.run([binary, *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def read_png(path) -> np.ndarray:
    """Decode an 8-bit RGB or RGBA PNG (all five row filters) to an (h, w, 3) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    bpp = 3 if color == 2 else 4
    rows = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(height, width * bpp + 1)
    out, prev = np.zeros((height, width * bpp), np.int64), np.zeros(width * bpp, np.int64)
    for y in range(height):
        kind, line = rows[y, 0], rows[y, 1:].astype(np.int64)
        if kind == 0:
            cur = line
        elif kind == 1:
            cur = np.cumsum(line.reshape(-1, bpp), axis=0).reshape(-1) & 255
        elif kind == 2:
            cur = (line + prev) & 255
        else:  # average and Paeth depend on the pixel to the left: byte by byte
            cur, p = line.tolist(), prev.tolist()
            for x in range(len(cur)):
                a = cur[x - bpp] if x >= bpp else 0
                if kind == 3:
                    cur[x] = (cur[x] + (a + p[x]) // 2) & 255
                else:
                    b, c = p[x], p[x - bpp] if x >= bpp else 0
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    cur[x] = (cur[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.array(cur, np.int64)
        out[y], prev = cur, cur
    return out.reshape(height, width, bpp)[:, :, :3].astype(np.uint8)


def test_report_in_headless_chromium(runs, page, tmp_path):
    binary = chromium()
    dom = browse(binary, tmp_path, page, "--dump-dom").stdout
    root = parse(dom)
    assert root.find_all("svg") and root.by_id("kernel-time").tag == "svg"  # the browser built SVG elements
    check_page(root, load(runs["strict"]), load(runs["adaptive"]), [runs["strict_trace"], runs["adaptive_trace"]])

    shot = tmp_path / "report.png"
    browse(binary, tmp_path, page, f"--screenshot={shot}", "--window-size=1280,1500", "--hide-scrollbars")
    pixels = read_png(shot)
    assert pixels.shape == (1500, 1280, 3)
    # the charts were painted: the comparison's adaptive bars and the fused-kernel bars
    for rgb, at_least in ((SECOND_RGB, 2000), (FUSED_RGB, 2000)):
        assert int((pixels == rgb).all(axis=2).sum()) >= at_least, rgb
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # text and charts, not a blank page


def test_readme_shows_the_committed_screenshot():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    png = (root / "docs" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] >= 1000
    assert "](docs/report.png)" in (root / "README.md").read_text()
