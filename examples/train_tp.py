"""Tensor parallel on neuron: a transformer-style MLP block split across the ranks.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/train_tp.py [--steps 20]

``init_device_mesh("neuron", ...)`` starts the default process group with the device's
default communication backend ``neuron`` (gloo on the bytes behind the device). The
block's first projection is split by columns (``ColwiseParallel``), the second by rows
(``RowwiseParallel``); the LayerNorm runs on each rank's part of the sequence
(``SequenceParallel``), and the vocabulary head stays split for the loss
(``loss_parallel``), so no rank ever holds all the logits. Every rank feeds the same
batch; each prints its collectives, bytes and simulated time.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

import adaptive_eager


class Block(nn.Module):
    def __init__(self, hidden: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(h)


def main() -> int:
    parser = argparse.ArgumentParser(description="Tensor parallel on neuron (run with torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    mesh = init_device_mesh("neuron", (int(os.environ["WORLD_SIZE"]),))  # torchrun sets WORLD_SIZE
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank, before it is split
    model = parallelize_module(Block().to("neuron"), mesh, {
        "embed": RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # one batch, the same on every rank, learnt by heart: the loss falls
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    tokens, labels = tokens.to("neuron"), tokens.roll(-1, dims=1).to("neuron")
    for step in range(1, args.steps + 1):
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {loss.full_tensor().item():.4f}", flush=True)
    up = model.up.weight
    stats = adaptive_eager.stats()["distributed"]
    print(f"rank {rank}: up.weight {tuple(up.shape)} split as {up.placements}, this rank holds {tuple(up.to_local().shape)}; "
          f"{stats['collectives']} collectives, {stats['bytes']:,} bytes, {stats['time_us']:.1f} us simulated", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
