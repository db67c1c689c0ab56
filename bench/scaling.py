"""Adaptive eager at realistic sizes, against strict eager, compiled mode and the roofline.

    python bench/scaling.py [--sizes 64,256,768,1024] [--workloads gpt,llama,decode]
                            [--modes strict,adaptive,neuron-compiled] [--save]

Workloads, at model width d with head dimension 64 (d // 64 heads, at least one), 2
layers:

- ``gpt``: a GPT-2-style training step (LayerNorm, GELU MLP of width 4d, AdamW), batch
  4 x 128 tokens, vocabulary 512;
- ``llama``: a Llama-style training step (RMSNorm, rotary embeddings, SwiGLU MLP of width
  8/3 d rounded to 64, AdamW), the same batch;
- ``decode``: greedy decoding of 16 tokens after an 8-token prompt, batch 1, KV cache.

Per (workload, size, mode), in a fresh process: launches, bytes moved and simulated
device time of one step (after a warm-up step; deterministic figures), and:

- the **roofline bound** of the step: ``max(FLOPs / peak, compulsory bytes / bandwidth)``
  at the device profile's float32 TensorE peak and DMA bandwidth (one logical NeuronCore,
  ``device/hardware/cost_model.py``), with
  no launch overhead. FLOPs are ``torch.utils.flop_counter``'s (matmuls and attention;
  elementwise work is not counted) for the step on the CPU. **Compulsory bytes**:
  - training: the weights read once and written once (2W), AdamW's two moments read once
    and written once (4W), the input tokens and targets read once, the loss written once,
    and every activation autograd saves for backward written once and read once (2A;
    A from ``saved_tensors_hooks`` on the CPU run, each storage once, parameters excluded);
  - decode: the weights read once for the whole loop (a kernel may keep them on chip
    across tokens: the compiled loop does when they fit), each new K and V written once,
    the prompt read once and each step's logits written once;
- ``adaptive / bound``: adaptive device time over the bound.

A launch-overhead sensitivity table (``--sensitivity``, default at d=768): the same
steps with ``NEURON_SIM_LAUNCH_US`` at 0, 2, 10 and 30 us, each measured afresh (the
adaptive policy's windows depend on the simulated backlog, so plans can change).

Results go to ``bench/results/latest/scaling.json`` (``bench/results/`` with ``--save``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import SAVE_HELP, provenance, results_path  # noqa: E402

SIZES = (64, 256, 768, 1024)
WORKLOADS = ("gpt", "llama", "decode")
MODES = ("strict", "adaptive", "neuron-compiled")
LAUNCH_US = (0, 2, 10, 30)
BATCH, SEQ, VOCAB, LAYERS = 4, 128, 512, 2
PROMPT, NEW_TOKENS = 8, 16


def _heads(dim: int) -> int:
    return max(1, dim // 64)


def build(workload: str, dim: int, device: str):
    """(step, model): one training or decoding step of ``workload`` at width ``dim``."""
    import torch
    import torch.nn.functional as F

    from bench.workloads import GPT, Decoder, Llama, greedy_decode

    torch.manual_seed(0)
    if workload == "decode":
        model = Decoder(vocab=VOCAB, dim=dim, heads=_heads(dim), layers=LAYERS).to(device).eval()
        prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)

        @torch.no_grad()
        def decode():
            return greedy_decode(model, prompt, NEW_TOKENS)

        return decode, model
    if workload == "gpt":
        model = GPT(vocab=VOCAB, dim=dim, heads=_heads(dim), layers=LAYERS, seq=SEQ)
    else:
        hidden = max(64, round(8 * dim / 3 / 64) * 64)
        model = Llama(vocab=VOCAB, dim=dim, heads=_heads(dim), hidden=hidden, layers=LAYERS)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def train():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return train, model


def roofline(workload: str, dim: int) -> dict:
    """The step's FLOPs, compulsory bytes and roofline bound (module docstring), from a CPU run."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from adaptive_eager_device.hardware.cost_model import PROFILE

    step, model = build(workload, dim, "cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    counter = FlopCounterMode(display=False)
    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    flops = counter.get_total_flops()
    if workload == "decode":
        itemsize = 4
        compulsory = weights + PROMPT * 8
        for new in [PROMPT] + [1] * NEW_TOKENS:
            compulsory += LAYERS * 2 * new * dim * itemsize + new * VOCAB * itemsize  # new K, V; logits
        activations = 0
    else:
        activations = sum(saved.values())
        tokens = 2 * BATCH * SEQ * 8  # inputs and targets (int64)
        compulsory = 6 * weights + tokens + 4 + 2 * activations
    compute_us = flops / PROFILE.peak_fp32_flops * 1e6
    memory_us = compulsory / PROFILE.dma_bytes_per_s * 1e6
    return {"flops": flops, "weight_bytes": weights, "saved_activation_bytes": activations,
            "compulsory_bytes": compulsory, "compute_us": compute_us, "memory_us": memory_us,
            "bound_us": max(compute_us, memory_us)}


def measure_one(workload: str, dim: int, mode: str) -> dict:
    """Launches, bytes and device time of one step on neuron, after a warm-up step."""
    import torch

    import adaptive_eager

    from adaptive_eager_device.core.config import CONFIG

    adaptive_eager.enable() if mode.startswith("adaptive") else adaptive_eager.disable()
    CONFIG.adaptive_policy = "torchneuron" if mode == "adaptive-torchneuron" else "ours"
    step, _ = build(workload, dim, "neuron")
    if mode == "neuron-compiled":
        step = torch.compile(step)
    step().cpu()
    adaptive_eager.reset_stats()
    started = time.perf_counter()
    step().cpu()
    wall = time.perf_counter() - started
    stats = adaptive_eager.stats()
    return {"launches": stats["kernels_launched"], "ops": stats["ops_recorded"], "bytes": stats["bytes_moved"],
            "device_time_us": stats["device_time_us"], "launch_overhead_us": stats["device"]["launch_overhead_us"],
            "wall_s": wall}


def _run(args: list, env: dict | None = None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, NEURON_ADAPTIVE_EAGER="0", **(env or {})))
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict) -> list[str]:
    lines = [f"{'workload':<8}{'d':>6}{'mode':>17}{'launches':>10}{'MiB':>10}{'device us':>11}{'bound us':>10}"
             f"{'/ bound':>9}{'strict/x':>10}"]
    lines.append("-" * len(lines[0]))
    for key, entry in results["sizes"].items():
        workload, dim = key.split("@")
        bound = entry["roofline"].get("bound_us")
        if bound is None:
            lines.append(f"{workload:<8}{dim:>6}  roofline error: {entry['roofline'].get('error')}")
            continue
        strict = entry["modes"].get("strict", {}).get("device_time_us")
        for mode, r in entry["modes"].items():
            if "error" in r:
                lines.append(f"{workload:<8}{dim:>6}{mode:>17}  error: {r['error']}")
                continue
            speedup = f"{strict / r['device_time_us']:.2f}x" if strict else "-"
            lines.append(f"{workload:<8}{dim:>6}{mode:>17}{r['launches']:>10}{r['bytes'] / (1 << 20):>10.1f}"
                         f"{r['device_time_us']:>11.0f}{bound:>10.0f}{r['device_time_us'] / bound:>9.2f}{speedup:>10}")
    if results.get("sensitivity"):
        lines += ["", "device time (us) at each assumed launch overhead (NEURON_SIM_LAUNCH_US):"]
        lines.append(f"{'workload':<8}{'d':>6}{'mode':>17}" + "".join(f"{f'{us} us':>10}" for us in LAUNCH_US))
        for key, by_mode in results["sensitivity"].items():
            workload, dim = key.split("@")
            for mode, by_us in by_mode.items():
                cells = "".join(f"{by_us[str(us)].get('device_time_us', float('nan')):>10.0f}" for us in LAUNCH_US)
                lines.append(f"{workload:<8}{dim:>6}{mode:>17}{cells}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/scaling.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sensitivity", default="768", help="sizes for the launch-overhead table ('' for none)")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("--one", nargs=3, metavar=("WORKLOAD", "DIM", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--roofline", nargs=2, metavar=("WORKLOAD", "DIM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)  # as bench/measure.py: one host thread beside the device worker
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.one[2])))
        return 0
    if args.roofline:
        print(json.dumps(roofline(args.roofline[0], int(args.roofline[1]))))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    results: dict = {"taken": provenance(), "sizes": {}, "sensitivity": {}}
    failed = False
    for workload in workloads:
        for dim in sizes:
            key = f"{workload}@{dim}"
            print(f"{key} ...", file=sys.stderr, flush=True)
            entry = results["sizes"][key] = {"roofline": _run(["--roofline", workload, str(dim)]), "modes": {}}
            failed |= "error" in entry["roofline"]
            for mode in modes:
                entry["modes"][mode] = _run(["--one", workload, str(dim), mode])
                failed |= "error" in entry["modes"][mode]
    for dim in [int(s) for s in args.sensitivity.split(",") if s]:
        for workload in workloads:
            by_mode = results["sensitivity"][f"{workload}@{dim}"] = {}
            for mode in modes:
                by_mode[mode] = {str(us): _run(["--one", workload, str(dim), mode], {"NEURON_SIM_LAUNCH_US": str(us)})
                                 for us in LAUNCH_US}
    with open(results_path("scaling.json", args.save), "w") as handle:
        json.dump(results, handle, indent=2)
    print("\n".join(table(results)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
