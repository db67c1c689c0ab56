"""Regenerate the README's screenshot of a ``torch.profiler`` trace, docs/profiler_trace.png.

    python -m bench.profiler_figure --polyfill PATH [--mode strict]

Profiles two training steps of a small model on ``neuron`` (``ProfilerActivity.CPU`` and
``PrivateUse1``, a schedule that records the second, ``tensorboard_trace_handler``), serves
the log folder with TensorBoard's PyTorch profiler plugin (``torch-tb-profiler``), opens
the plugin's own trace view (``trace_embedding.html``: Chromium's Trace Viewer, the one
``chrome://tracing`` was) in headless Chromium, hands it the trace the plugin serves, as
the plugin's Trace tab does, zooms to the forward pass and takes the screenshot. Records
when, at which commit and on what machine in ``docs/figures.json``.

Not project dependencies; what it needs: Debian's ``chromium``; ``pip install tensorboard
torch-tb-profiler playwright`` (Playwright drives the system Chromium, no browser
download); the Web Components polyfill the trace view loads from a CDN (offline here:
``npm pack webcomponents.js@0.7.24`` and pass ``package/webcomponents.min.js`` as
``--polyfill``). The plugin's React shell is not used: its Overview needs Google Charts,
a web service. Exit status 2 when something is missing.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench import provenance  # noqa: E402

PNG = os.path.join(ROOT, "docs", "profiler_trace.png")
RECORD = os.path.join(ROOT, "docs", "figures.json")

PROFILED = r'''
import sys
import torch
import adaptive_eager
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

mode, logdir = sys.argv[1], sys.argv[2]
adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to("neuron")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64).to("neuron"), torch.randint(0, 10, (32,)).to("neuron")


def step():
    with record_function("forward"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad()
    torch.neuron.synchronize()


with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
             schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
             on_trace_ready=tensorboard_trace_handler(logdir, worker_name=mode)) as prof:
    for _ in range(2):
        adaptive_eager.reset_stats()
        step()
        prof.step()
stats = adaptive_eager.stats()
print(stats["ops_recorded"], stats["kernels_launched"])
'''

# A page of ours on TensorBoard's origin that holds the plugin's trace view in an iframe,
# as the plugin's Trace tab does, and hands it the trace the plugin serves (postMessage).
HOST = """<!DOCTYPE html><html><body style="margin:0">
<iframe id="view" src="data/plugin/pytorch_profiler/trace_embedding.html" style="border:0;width:100vw;height:100vh"></iframe>
<script>
window.addEventListener("message", async (event) => {
  if ((event.data || {}).msg !== "ready") return;
  const plugin = "data/plugin/pytorch_profiler/";
  const spans = await (await fetch(`${plugin}spans?run=RUN&worker=RUN`)).json();
  const text = await (await fetch(`${plugin}trace?run=RUN&worker=RUN&span=${spans[0]}`)).text();
  document.getElementById("view").contentWindow.postMessage({msg: "data", name: "RUN", data: text}, "*");
});
</script></body></html>"""
# In the trace view: zoom to the forward pass, from the first op issued to the end of its
# fifth kernel (the forward's five, in strict mode).
ZOOM = """() => {
    const viewer = document.getElementById('trace-viewer');
    const model = viewer && viewer.model;
    if (!model) return null;
    const kernels = [], issues = [];
    for (const event of model.getDescendantEvents()) {
        if (event.category === 'kernel') kernels.push(event);
        if (event.title === 'neuron::enqueue') issues.push(event.start);
    }
    if (!kernels.length || !issues.length) return 'no kernels';
    kernels.sort((a, b) => a.start - b.start);
    const first = Math.min(...issues), last = kernels[Math.min(4, kernels.length - 1)].end;
    const span = last - first;
    const viewport = viewer.trackView.viewport;
    const transform = new tr.ui.TimelineDisplayTransform();
    transform.set(viewport.currentDisplayTransform);
    transform.xSetWorldBounds(first - 0.35 * span, last + 0.1 * span, viewport.modelTrackContainer.canvas.clientWidth);
    viewport.setDisplayTransformImmediately(transform);
    viewport.selectedFlowEvents = new Set(['ac2g']);  // the "Flow events" menu's ac2g box: op -> kernel
    viewer.brushingStateController.changeSelectionFromTimeline(new tr.model.EventSet([kernels[0]]));
    viewport.dispatchChangeEvent();
    return span;
}"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_run(base: str, run: str, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/data/plugin/pytorch_profiler/runs", timeout=5) as reply:
                data = json.load(reply)
            if run in data.get("runs", []) and not data.get("loading"):
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("TensorBoard did not load the run")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profiler_figure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--polyfill", required=True, help="webcomponents.min.js of webcomponents.js 0.7.24 (npm)")
    parser.add_argument("--mode", choices=("strict", "adaptive"), default="strict")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=820)
    args = parser.parse_args(argv)
    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    tensorboard = shutil.which("tensorboard", path=os.path.dirname(sys.executable)) or shutil.which("tensorboard")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = [name for name, found in (("chromium", browser_path), ("tensorboard", tensorboard),
                                        ("playwright", sync_playwright), ("--polyfill", os.path.exists(args.polyfill)))
               if not found]
    if missing:
        print(f"error: missing {', '.join(missing)} (see python -m bench.profiler_figure --help)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        logdir = os.path.join(scratch, args.mode)  # the run's name in TensorBoard: its folder's
        done = subprocess.run([sys.executable, "-c", PROFILED, args.mode, logdir], check=True,
                              capture_output=True, text=True)
        ops, launches = (int(v) for v in done.stdout.split()[-2:])
        trace = json.load(open(glob.glob(os.path.join(logdir, "*.json"))[0]))["traceEvents"]
        kernels = sum(1 for e in trace if e.get("cat") == "kernel")
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([tensorboard, "--logdir", scratch, "--port", str(port), "--host", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_run(base, args.mode)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": args.width, "height": args.height})
                page.route("**/webcomponents.min.js",
                           lambda route: route.fulfill(path=args.polyfill, content_type="application/javascript"))
                page.route(f"{base}/neuron_figure.html",
                           lambda route: route.fulfill(body=HOST.replace("RUN", args.mode), content_type="text/html"))
                page.goto(f"{base}/neuron_figure.html")
                view = None
                for _ in range(120):
                    view = next((f for f in page.frames if f.url.endswith("trace_embedding.html")), None)
                    if view is not None and view.evaluate(
                            "() => !!(document.getElementById('trace-viewer') || {}).model"):
                        break
                    time.sleep(1)
                time.sleep(2)
                zoomed = view.evaluate(ZOOM)
                if not isinstance(zoomed, (int, float)):
                    raise RuntimeError(f"could not zoom: {zoomed}")
                time.sleep(2)
                page.screenshot(path=PNG)
                browser.close()
        finally:
            server.terminate()
            server.wait()
    record = json.load(open(RECORD)) if os.path.exists(RECORD) else {}
    record["docs/profiler_trace.png"] = {
        "command": f"python -m bench.profiler_figure --polyfill webcomponents.min.js --mode {args.mode}",
        "viewer": "TensorBoard's PyTorch profiler plugin (torch-tb-profiler), its trace view, in headless Chromium",
        "taken": provenance(),
        "figures": {"ops_recorded": ops, "kernels_launched": launches, "kernel_events": kernels},
    }
    with open(RECORD, "w") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
    print(f"wrote {PNG} ({launches} launches, {kernels} kernel events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
