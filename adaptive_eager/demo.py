"""Train a small GPT-style language model on the simulated neuron device, in strict eager
and then in adaptive eager, and compare what the device did.

python -m adaptive_eager.demo [--steps N] [--mode both|strict|adaptive]

The model is written the way people write it in eager PyTorch (hand-written attention,
LayerNorm, GELU MLP, cross-entropy, AdamW, grad clipping); the only device-specific line
is .to('neuron'). The data is a synthetic corpus with structure to learn (a repeated
grammar of tokens), so the loss visibly falls. Both modes run the same model, data and
seed in this process (adaptive_eager.enable()/disable() switch between them, reset_stats() zeroes
the counters in between), so their statistics compare like for like and their losses
must be identical: the demo checks it, and against the same training on the CPU.
"""
from __future__ import annotations

import argparse
import math
import textwrap
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager.report_text import format_stats, launch_overhead_us

class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, dim)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def synthetic_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    """Sequences of a simple grammar: runs of rising tokens with random starts."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, vocab, (batch, 1), generator=generator)
        strides = torch.randint(1, 4, (batch, 1), generator=generator)
        tokens = (starts + strides * torch.arange(seq + 1)) % vocab
        yield tokens[:, :-1], tokens[:, 1:]


def train(steps: int = 30, device: str = "neuron", log_every: int = 10, log=print) -> list[float]:
    """Train TinyGPT for ``steps`` steps; returns every step's loss. ``log`` prints the
    loss of the first step and every ``log_every``-th (a sync point: ``.item()``)."""
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    losses = []
    for step, (inputs, targets) in enumerate(synthetic_batches(steps, 16, 32, 64), 1):
        inputs, targets = inputs.to(device), targets.to(device)
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())  # kept on the device: read once, at the end
        if step % log_every == 0 or step == 1:
            log(f"  step {step:4d}  loss {loss.item():.4f}")
    return torch.stack(losses).cpu().tolist()


MODES = {
    "strict": "each aten op is one kernel launch on the device's single queue, as eager PyTorch runs on a GPU "
              "(the default; NEURON_ADAPTIVE_EAGER=0).",
    "adaptive": "ops wait in a short window; chains that can fuse run as one kernel, so the device gets far fewer "
                "launches and less memory traffic (NEURON_ADAPTIVE_EAGER=1, or adaptive_eager.enable()).",
}


def run(mode: str, steps: int, log=print, restore: bool = True) -> dict:
    """Train in one mode from zeroed statistics; the statistics, losses and wall time.
    ``restore=False`` stays in that mode afterwards (so a NEURON_FUSION_STATS dump at
    exit names it)."""
    previous = adaptive_eager.is_enabled()
    adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    try:
        adaptive_eager.reset_stats()
        started = time.perf_counter()
        losses = train(steps, log=log)
        stats = adaptive_eager.stats()
        elapsed = time.perf_counter() - started
    finally:
        if restore:
            adaptive_eager.enable() if previous else adaptive_eager.disable()
    return {"stats": stats, "losses": losses, "seconds": elapsed}


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}x" if a else "-"


def side_by_side(strict: dict, adaptive: dict, cpu_losses: list[float]) -> tuple[list[str], bool]:
    """The comparison table and the loss check; (lines, losses identical)."""
    s, a = strict["stats"], adaptive["stats"]
    overhead = launch_overhead_us(s)
    rows = [
        ("aten ops issued", f"{s['ops_recorded']:,}", f"{a['ops_recorded']:,}", _ratio(s["ops_recorded"], a["ops_recorded"])),
        ("kernel launches", f"{s['kernels_launched']:,}", f"{a['kernels_launched']:,}",
         _ratio(s["kernels_launched"], a["kernels_launched"])),
        ("bytes moved (MiB)", f"{s['bytes_moved'] / 2**20:,.1f}", f"{a['bytes_moved'] / 2**20:,.1f}",
         _ratio(s["bytes_moved"], a["bytes_moved"])),
        ("simulated device time (ms)", f"{s['device_time_us'] / 1000:,.2f}", f"{a['device_time_us'] / 1000:,.2f}",
         _ratio(s["device_time_us"], a["device_time_us"])),
        (f"  of it launch overhead ({overhead:g} us each)", f"{s['kernels_launched'] * overhead / 1000:,.2f}",
         f"{a['kernels_launched'] * overhead / 1000:,.2f}", ""),
        ("fused kernels launched", f"{s['fused_kernels']:,}", f"{a['fused_kernels']:,}", ""),
        ("final loss", f"{strict['losses'][-1]:.6f}", f"{adaptive['losses'][-1]:.6f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows + [("", "strict", "adaptive", "adaptive/strict")]) for i in range(4)]
    header = ("", "strict", "adaptive", "adaptive/strict")
    lines = ["  " + "  ".join(f"{c:<{widths[0]}}" if i == 0 else f"{c:>{widths[i]}}" for i, c in enumerate(row)).rstrip()
             for row in [header] + rows]
    same = strict["losses"] == adaptive["losses"]
    steps = len(strict["losses"])
    if same:
        lines.append(f"  losses: strict and adaptive identical, bit for bit, at all {steps} steps")
    else:
        worst = max(abs(x - y) for x, y in zip(strict["losses"], adaptive["losses"]))
        lines.append(f"  losses: strict and adaptive DIFFER (max |diff| {worst:.3g}): a bug, please report it")
    worst_cpu = max(abs(x - y) for x, y in zip(cpu_losses, adaptive["losses"]))
    lines.append("  the same training on the CPU: " + (
        "identical losses" if worst_cpu == 0 else f"losses within {worst_cpu:.3g} (max |diff|)"))
    return lines, same


NEXT_STEPS = """Simulated device time is the simulator's cost model, not hardware: each kernel costs an
assumed launch overhead ({overhead:g} us, NEURON_SIM_LAUNCH_US) plus the busiest of its engines
and its memory traffic on one logical NeuronCore of Trainium2; for a model this small it is
mostly launches x {overhead:g} us.

See more (the README's "Seeing what happened"):
  python -m adaptive_eager.demo --mode adaptive    # one mode, with its full statistics
  NEURON_FUSION_STATS=strict.json NEURON_TRACE=strict_trace.json python -m adaptive_eager.demo --mode strict
  NEURON_FUSION_STATS=adaptive.json NEURON_TRACE=adaptive_trace.json python -m adaptive_eager.demo --mode adaptive
  python -m adaptive_eager.stats strict.json adaptive.json    # the two runs side by side, with ratios
  python -m adaptive_eager.report strict.json adaptive.json --trace strict_trace.json --trace adaptive_trace.json -o report.html
  python -m adaptive_eager.compare your_script.py    # strict, our policy and TorchNeuron's, side by side"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m adaptive_eager.demo",
        description="Train a small GPT on the simulated neuron device in strict eager, then in adaptive eager, "
                    "and print what the device did in each mode side by side (launches, bytes moved, simulated "
                    "device time, losses). With --mode, train in one mode and print its full statistics.",
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps per mode (default 30)")
    parser.add_argument("--mode", choices=("both", "strict", "adaptive"), default="both",
                        help="both (default): strict, then adaptive, side by side; or one mode with its full statistics")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.mode != "both":
        print(f"training TinyGPT on neuron in {args.mode} eager for {args.steps} steps:", flush=True)
        print("\n".join(textwrap.wrap(MODES[args.mode], 92, initial_indent="  ", subsequent_indent="  ")), flush=True)
        result = run(args.mode, args.steps, restore=False)
        print(f"done in {result['seconds']:.1f} s\n")
        print(format_stats(result["stats"]))
        return 0
    print(f"TinyGPT (2 layers, {sum(p.numel() for p in TinyGPT().parameters()):,} parameters), the same data and seed,\n"
          f"{args.steps} training steps on the simulated neuron device, in each mode:")
    for mode, meaning in MODES.items():
        print("\n".join(textwrap.wrap(meaning, 92, initial_indent=f"  {mode + ' eager':<16}", subsequent_indent=" " * 18)))
    if CONFIG.stats_path or CONFIG.trace_path:
        print("  note: NEURON_FUSION_STATS and NEURON_TRACE files of this run hold both modes' work (the statistics:"
              " the adaptive run's only); run each mode with --mode for one file per mode")
    results = {}
    for mode in MODES:
        print(f"\n{mode} eager", flush=True)
        results[mode] = run(mode, args.steps, log=lambda line: print(line, flush=True))
        print(f"  done in {results[mode]['seconds']:.1f} s (wall time of the simulation on this CPU; not a device figure)")
    print("\nthe same training on the CPU, for reference: ", end="", flush=True)
    cpu_losses = train(args.steps, device="cpu", log=lambda line: None)
    print("done")
    lines, same = side_by_side(results["strict"], results["adaptive"], cpu_losses)
    print("\nwhat the device did\n" + "\n".join(lines) + "\n")
    print(NEXT_STEPS.format(overhead=launch_overhead_us(results["strict"]["stats"])))
    return 0 if same else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:  # `... | head`
        import sys

        sys.stderr.close()
        raise SystemExit(0)
