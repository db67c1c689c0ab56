"""Bad input and faults on the neuron backend, two processes over 127.0.0.1: collectives
whose ranks disagree raise a clear error naming the op on every rank (gloo alone returns
wrong numbers on one rank); a mesh larger than the world is refused; a rank that dies in
the middle of FSDP2 training gives its peer an error, not a hang. Also: a collective is
costed on the simulated queue with the world's size and the bytes it moves."""
from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.multiprocessing as mp

from test_distributed_apis import free_port

PG_TIMEOUT_S = 120  # the peer's error must come from the lost connection, long before this


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _faults(rank, world, port, out_dir):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import adaptive_eager
    import distributed_scenarios as S
    from adaptive_eager_device.hardware.cost_model import PROFILE

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    out = {}
    out["all_reduce"] = _error(lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 3, device="neuron")))
    out["all_gather"] = _error(lambda: dist.all_gather_into_tensor(
        torch.empty(8, device="neuron"), torch.ones(4, device="neuron", dtype=torch.float32 if rank == 0 else torch.float16)))
    out["different_ops"] = _error(lambda: dist.all_reduce(torch.ones(2, device="neuron")) if rank == 0
                                  else dist.broadcast(torch.ones(2, device="neuron"), src=0))
    out["mesh"] = _error(lambda: init_device_mesh("neuron", (2 * world,)))
    # the group still works after the refusals
    x = torch.full((3,), float(rank + 1), device="neuron")
    dist.all_reduce(x)
    out["after"] = x.cpu().tolist()
    # costs: a 1024-float all-reduce and all-gather, with the profile's formula
    adaptive_eager.reset_stats()
    dist.all_reduce(torch.ones(1024, device="neuron"))
    dist.all_gather_into_tensor(torch.empty(1024 * world, device="neuron"), torch.ones(1024, device="neuron"))
    by_op = adaptive_eager.stats()["distributed"]["by_op"]
    out["by_op"] = by_op
    out["expected_us"] = {"c10d::allreduce_": PROFILE.collective_time_us(4096, world, True),
                          "c10d::_allgather_base_": PROFILE.collective_time_us(4096 * world, world, False)}
    # a rank dies in the middle of training
    mesh = init_device_mesh("neuron", (world,))
    model = S._fsdp_model("neuron", mesh)
    data, target = S._mlp_data(world)
    started = time.monotonic()
    try:
        for step in range(50):
            if rank == 1 and step == 2:
                with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
                    json.dump(out, handle)
                os._exit(3)  # no clean-up: the process is gone
            F.mse_loss(model(data.to("neuron")), target.to("neuron")).backward()
            torch.neuron.synchronize()
        out["peer_death"] = "no error"
    except Exception as error:  # noqa: BLE001
        out["peer_death"] = f"{type(error).__name__}: {error}"
    out["seconds"] = time.monotonic() - started
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(out, handle)
    os._exit(0)  # the group cannot be destroyed cleanly with a peer gone


def test_disagreeing_collectives_a_too_large_mesh_and_a_dying_rank(tmp_path):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_faults, args=(rank, 2, port, str(tmp_path))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=PG_TIMEOUT_S + 60)
        assert not process.is_alive(), "a rank hung"
    assert processes[1].exitcode == 3
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, r in enumerate(results):
        # every rank raises, and the message names the op and what each rank passed
        assert r["all_reduce"].startswith("RuntimeError: c10d::allreduce_: the ranks of the process group disagree")
        assert "rank 0 of the group: c10d::allreduce_(float32[4])" in r["all_reduce"]
        assert "rank 1 of the group: c10d::allreduce_(float32[3])" in r["all_reduce"]
        assert "c10d::_allgather_base_(float32[8]; float16[4])" in r["all_gather"], r["all_gather"]
        assert "c10d::broadcast_" in r["different_ops"] and "c10d::allreduce_" in r["different_ops"]
        assert "Mesh should not be bigger than default world size 2" in r["mesh"], r["mesh"]
        assert r["after"] == [3.0] * 3
        for op, expected in r["expected_us"].items():
            assert r["by_op"][op]["calls"] == 1
            assert abs(r["by_op"][op]["time_us"] - expected) < 1e-3, (op, r["by_op"][op], expected)
        assert r["by_op"]["c10d::_allgather_base_"]["bytes"] == 4096 * 2  # the gathered tensor
    survivor = results[0]
    assert survivor["peer_death"] != "no error", survivor
    assert "remote worker" in survivor["peer_death"], survivor  # gloo: connection closed or reset by the peer
    assert survivor["seconds"] < PG_TIMEOUT_S / 2, survivor  # the lost peer was noticed, not timed out
