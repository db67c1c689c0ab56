"""An unmodified DDP training script, run on neuron: the README's distributed example.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/train_ddp.py [--steps 20]

Each rank trains the same small MLP on its shard of a synthetic regression batch; DDP
all-reduces the gradients over the gloo process group (on the bytes behind the device),
so every rank ends with the same parameters. Rank 0 prints the loss and checks that.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    parser = argparse.ArgumentParser(description="DDP on neuron (run with torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to("neuron")
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        x = torch.randn(8 * world, 16, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        x, y = x[rank::world].to("neuron"), y[rank::world].to("neuron")  # this rank's shard
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    # every rank holds the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g.cpu(), gathered[0].cpu()) for g in gathered)
    if rank == 0:
        print(f"{world} ranks, parameters identical on every rank: {same}")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
