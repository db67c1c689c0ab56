"""Distributed training scenarios on ``neuron`` meshes, shared by tests/integrations/test_distributed_apis.py:
each ``run_<name>(mesh_or_world, out)`` trains on the ranks of a process group and returns
what the test compares; each ``reference_<name>()`` trains the same model on one CPU
process on the whole batch. Models, data and initial weights are drawn on the CPU from
fixed seeds, identically in every process.

The ranks are started by :func:`worker` (mp.spawn), which initializes the default
backend (no backend named: the device's ``neuron`` backend) and runs the scenarios it is
given one after another, writing ``<scenario>.rank<r>.pt`` per rank (or the traceback of
its failure, so one broken scenario does not hide the others).
"""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
LR = 0.1


def _cpu(t):
    return t.detach().cpu().clone()


def _full(p):
    from torch.distributed.tensor import DTensor

    return _cpu(p.full_tensor() if isinstance(p, DTensor) else p)


def _params(model):
    return {name: _full(p) for name, p in model.named_parameters()}


def _distributed_stats():
    import adaptive_eager

    return adaptive_eager.stats()["distributed"]


# ---------------------------------------------------------------------------------------
# DTensor: placements, redistribute, full_tensor, and training a sharded parameter


def _dtensor_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(8, 4, generator=g)


def run_dtensor(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("neuron", (world,))
    rank = mesh.get_local_rank()
    a, w0, target = _dtensor_data()
    out = {}
    shard0 = distribute_tensor(a.to("neuron"), mesh, [Shard(0)])
    out["shard0_local"] = _cpu(shard0.to_local())
    out["shard0_full"] = _cpu(shard0.full_tensor())
    out["shard0_to_shard1"] = _cpu(shard0.redistribute(mesh, [Shard(1)]).to_local())
    out["shard0_to_replicate"] = _cpu(shard0.redistribute(mesh, [Replicate()]).to_local())
    partial = DTensor.from_local(torch.full((3, 2), float(rank + 1), device="neuron"), mesh, [Partial()])
    out["partial_to_replicate"] = _cpu(partial.redistribute(mesh, [Replicate()]).to_local())
    out["partial_to_shard0"] = _cpu(partial.redistribute(mesh, [Shard(0)]).to_local())
    replicated = distribute_tensor(w0.to("neuron"), mesh, [Replicate()])
    out["matmul_shard_replicate"] = _cpu((shard0 @ replicated.T).full_tensor())
    out["sum_of_shard"] = _cpu(shard0.sum().full_tensor())  # a Partial result, reduced
    # training: a weight sharded on its rows, data replicated
    weight = nn.Parameter(distribute_tensor(w0.to("neuron"), mesh, [Shard(0)]))
    optimizer = torch.optim.SGD([weight], lr=LR, momentum=0.9)
    x = distribute_tensor(a.to("neuron"), mesh, [Replicate()])
    y = distribute_tensor(target.to("neuron"), mesh, [Replicate()])
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((torch.tanh(x @ weight.T) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
    out["trained_weight"] = _full(weight)
    out["loss"] = _cpu(loss.full_tensor())
    return out


def reference_dtensor(world):
    a, w0, target = _dtensor_data()
    out = {
        "shard0_local": [a.chunk(world, 0)[r] for r in range(world)],
        "shard0_full": a,
        "shard0_to_shard1": [a.chunk(world, 1)[r] for r in range(world)],
        "shard0_to_replicate": a,
        "partial_to_replicate": torch.full((3, 2), float(sum(range(1, world + 1)))),
        "partial_to_shard0": [torch.full((3, 2), float(sum(range(1, world + 1)))).tensor_split(world, 0)[r]
                              for r in range(world)],
        "matmul_shard_replicate": a @ w0.T,
        "sum_of_shard": a.sum(),
    }
    weight = nn.Parameter(w0.clone())
    optimizer = torch.optim.SGD([weight], lr=LR, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((torch.tanh(a @ weight.T) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
    out["trained_weight"] = weight.detach()
    out["loss"] = loss.detach()
    return out


# ---------------------------------------------------------------------------------------
# Tensor parallel: SequenceParallel norm, ColwiseParallel / RowwiseParallel MLP, a
# vocabulary-parallel head with loss_parallel


class TPNet(nn.Module):
    def __init__(self, hidden=16, vocab=10) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.down(F.relu(self.up(self.norm(x)))))


def _tp_data():
    torch.manual_seed(0)
    model = TPNet()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 16, generator=g)
    labels = torch.randint(0, 10, (2, 4), generator=g)
    return model, x, labels


def run_tp(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)

    mesh = init_device_mesh("neuron", (world,))
    rank = mesh.get_local_rank()
    model, x, labels = _tp_data()
    model = parallelize_module(model.to("neuron"), mesh, {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    local_x = x.chunk(world, dim=1)[rank].to("neuron")  # this rank's part of the sequence
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(local_x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten().to("neuron"))
            loss.backward()
        optimizer.step()
    return {"params": _params(model), "loss": _full(loss), "stats": _distributed_stats()}


def reference_tp(world):
    model, x, labels = _tp_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
    return {"params": _params(model), "loss": loss.detach()}


# ---------------------------------------------------------------------------------------
# FSDP2


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _mlp_data(world):
    g = torch.Generator().manual_seed(1)
    return torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 2, generator=g)


def _fsdp_model(device, mesh, reshard_after_forward=True, mp_policy=None, offload=False):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              "mp_policy": mp_policy or MixedPrecisionPolicy(),
              "offload_policy": CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()}
    model = _mlp().to("cpu" if offload else device)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train_fsdp(model, device, world, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data, target = _mlp_data(world)
    shard = slice(rank * 4, (rank + 1) * 4)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data[shard].to(device)).float(), target[shard].to(device))
        loss.backward()
        optimizer.step()
    return optimizer


def run_fsdp2(world):
    """FSDP2 on a neuron mesh: resharding after forward or not, CPU offload, and bf16
    mixed precision; the last also on a CPU mesh over the same group (the reference for
    bf16: the same algorithm, run by CPU PyTorch)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("neuron", (world,))
    rank = dist.get_rank()
    out = {}
    for name, options in {
        "reshard": {"reshard_after_forward": True},
        "no_reshard": {"reshard_after_forward": False},
        "offload": {"offload": True},
    }.items():
        model = _fsdp_model("neuron", mesh, **options)
        _train_fsdp(model, "neuron", world, rank)
        out[name] = _params(model)
        if name == "offload":
            out["offload_param_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for device in ("neuron", "cpu"):
        model = _fsdp_model(device, init_device_mesh(device, (world,)), mp_policy=bf16)
        _train_fsdp(model, device, world, rank)
        out[f"bf16_{device}"] = _params(model)
    out["stats"] = _distributed_stats()
    return out


def reference_fsdp2(world):
    model = _mlp()
    data, target = _mlp_data(world)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(data), target).backward()
        optimizer.step()
    return {"params": _params(model)}


# ---------------------------------------------------------------------------------------
# torch.distributed.checkpoint: save sharded FSDP2 state, load it into a fresh model


def run_checkpoint(world, directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("neuron", (world,))
    rank = dist.get_rank()
    model = _fsdp_model("neuron", mesh)
    optimizer = _train_fsdp(model, "neuron", world, rank)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=directory)
    saved = _params(model)
    # a fresh model, different weights, loads the checkpoint in place
    fresh = _fsdp_model("neuron", mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9)
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optimizer)}
    dcp.load(state, checkpoint_id=directory)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, state["optim"])
    loaded = _params(fresh)
    # one more step on both: the momentum buffers came back too
    data, target = _mlp_data(world)
    shard = slice(rank * 4, (rank + 1) * 4)
    for m, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        opt.zero_grad()
        F.mse_loss(m(data[shard].to("neuron")), target[shard].to("neuron")).backward()
        opt.step()
    local_shapes = {name: tuple(p.to_local().shape) for name, p in fresh.named_parameters()}
    return {"saved": saved, "loaded": loaded, "after_step": _params(model), "fresh_after_step": _params(fresh),
            "local_shapes": local_shapes}


# ---------------------------------------------------------------------------------------
# Pipeline parallel: two stages, GPipe and 1F1B


def _pp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def run_pipeline(world):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    assert world == 2
    rank = dist.get_rank()
    data, target = _mlp_data(world)
    out = {}
    for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        full = _pp_model()
        stage_module = (full[:2] if rank == 0 else full[2:]).to("neuron")
        stage = PipelineStage(stage_module, rank, world, torch.device("neuron"))
        schedule = schedule_class(stage, n_microbatches=4, loss_fn=F.mse_loss)
        optimizer = torch.optim.SGD(stage_module.parameters(), lr=LR, momentum=0.9)
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(data.to("neuron"))
            else:
                step_losses = []
                schedule.step(target=target.to("neuron"), losses=step_losses)
                losses.append(_cpu(torch.stack(step_losses).mean()))
            optimizer.step()
        out[name] = {"params": _params(stage_module), "losses": losses}
    return out


def reference_pipeline(world):
    model = _pp_model()
    data, target = _mlp_data(world)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    params = _params(model)
    stage0 = {k: v for k, v in params.items() if k.split(".")[0] in ("0", "1")}
    stage1 = {k: v for k, v in params.items() if k not in stage0}  # full[2:] keeps the names
    return {"stage_params": [stage0, stage1], "losses": losses}


# ---------------------------------------------------------------------------------------
# A 2-D mesh: FSDP2 over "dp", tensor parallel over "tp" (4 ranks)


def run_fsdp_tp(world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("neuron", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp().to("neuron")
    parallelize_module(model, mesh["tp"], {"2": ColwiseParallel(), "4": RowwiseParallel()})
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data, target = _mlp_data(world // 2)
    dp_rank = mesh["dp"].get_local_rank()
    shard = slice(dp_rank * 4, (dp_rank + 1) * 4)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(data[shard].to("neuron")), target[shard].to("neuron")).backward()
        optimizer.step()
    return {"params": _params(model), "rank": dist.get_rank()}


def reference_fsdp_tp(world):
    return reference_fsdp2(world // 2)


# ---------------------------------------------------------------------------------------


def run_scenario(name, world, out_dir):
    if name == "checkpoint":
        return run_checkpoint(world, os.path.join(out_dir, "checkpoint"))
    return globals()[f"run_{name}"](world)


def worker(rank, world, port, adaptive, out_dir, scenarios, timeout_s=60):
    import torch.distributed as dist

    import adaptive_eager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    adaptive_eager.enable() if adaptive else adaptive_eager.disable()
    dist.init_process_group(timeout=datetime.timedelta(seconds=timeout_s))  # no backend named
    backend = {"config": dist.get_backend_config(), "devices": [d.type for d in dist.group.WORLD._device_types],
               "mode": adaptive_eager.stats()["mode"]}
    torch.save(backend, os.path.join(out_dir, f"backend.rank{rank}.pt"))
    for name in scenarios:
        adaptive_eager.reset_stats()
        path = os.path.join(out_dir, f"{name}.rank{rank}.pt")
        try:
            torch.save(run_scenario(name, world, out_dir), path)
        except Exception:
            with open(path + ".error", "w") as handle:
                handle.write(traceback.format_exc())
    dist.destroy_process_group()
