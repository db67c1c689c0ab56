"""The main job: train a small GPT-style language model on ``neuron`` and print the
statistics. ``python -m adaptive_eager.demo [--steps N]``; set
``NEURON_ADAPTIVE_EAGER=1`` for adaptive eager.

The model is written the way people write it in eager PyTorch (hand-written attention,
LayerNorm, GELU MLP, cross-entropy, AdamW, grad clipping); the only device-specific line
is ``.to('neuron')``. The data is a synthetic corpus with structure to learn (a repeated
grammar of tokens), so the loss visibly falls.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager.report_text import format_stats


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


def train(steps: int = 60, device: str = "neuron", log_every: int = 10) -> list[float]:
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
        if step % log_every == 0 or step == 1:
            losses.append(loss.item())
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_eager.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    mode = adaptive_eager.stats()["mode"]
    print(f"training TinyGPT on neuron ({mode} eager) for {args.steps} steps")
    started = time.perf_counter()
    train(args.steps)
    elapsed = time.perf_counter() - started
    print(f"done in {elapsed:.1f} s\n")
    print(format_stats(adaptive_eager.stats()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
