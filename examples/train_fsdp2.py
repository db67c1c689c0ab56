"""FSDP2 (fully_shard) on neuron: each rank holds a shard of every parameter.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/train_fsdp2.py [--steps 20]

``init_device_mesh("neuron", ...)`` starts the default process group itself, with the
device's default communication backend ``neuron`` (gloo on the bytes behind the device).
Each layer is sharded over the mesh; forward all-gathers a layer's parameters, backward
reduce-scatters its gradients. With ``--bf16`` the parameters are all-gathered in bf16
(``MixedPrecisionPolicy``) and gradients reduced in fp32. Each rank prints what it sent
over the (simulated) link: collectives, bytes and simulated time.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import adaptive_eager


def main() -> int:
    parser = argparse.ArgumentParser(description="FSDP2 on neuron (run with torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters in forward and backward")
    args = parser.parse_args()
    mesh = init_device_mesh("neuron", (int(os.environ["WORLD_SIZE"]),))  # torchrun sets WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank, before sharding
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)).to("neuron")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        x = torch.randn(8 * world, 16, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        x, y = x[rank::world].to("neuron"), y[rank::world].to("neuron")  # this rank's shard of the batch
        loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()  # reduce-scatters the gradients into each rank's shard
        optimizer.step()
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    weight = model[0].weight
    local = tuple(weight.to_local().shape)
    full = tuple(weight.full_tensor().shape)  # an all-gather
    stats = adaptive_eager.stats()["distributed"]
    print(f"rank {rank}: first weight {full}, this rank holds {local}; {stats['collectives']} collectives, "
          f"{stats['bytes']:,} bytes, {stats['time_us']:.1f} us simulated", flush=True)
    dist.destroy_process_group()
    return 0 if local[0] * world == full[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
