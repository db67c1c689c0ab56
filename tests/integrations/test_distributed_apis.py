"""Distributed APIs beyond DDP on neuron meshes, two processes over 127.0.0.1, in both
modes, each against single-process CPU training (tests/distributed_scenarios.py):
DTensor, tensor parallel (with sequence parallel and loss_parallel), FSDP2 (resharding
both ways, CPU offload, bf16 mixed precision), torch.distributed.checkpoint and pipeline
parallel; plus the ``neuron`` communication backend itself and per-rank statistics.

The ranks of one mode run every scenario in one pair of processes (a module fixture):
starting processes is most of the cost. Every run is bounded in time (the process group's
timeout, pytest-timeout).
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import distributed_scenarios as S

WORLD = 2
SCENARIOS = ("dtensor", "tp", "fsdp2", "checkpoint", "pipeline")
# Parameters after STEPS steps, against single-process CPU training: the bound.
# Sharded training sums the same products in another order (per-rank partial sums, then
# the reduction), so equality is to rounding, not bitwise.
ATOL = RTOL = 1e-5
PARITY: dict = {}  # (mode, api) -> largest |difference|, printed at the end (pytest -s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["strict", "adaptive"])
def ranks(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"ranks_{request.param}")
    mp.spawn(S.worker, args=(WORLD, free_port(), request.param == "adaptive", str(out_dir), SCENARIOS),
             nprocs=WORLD, join=True)
    return request.param, out_dir


def results(ranks, name):
    mode, out_dir = ranks
    errors = [(out_dir / f"{name}.rank{r}.pt.error") for r in range(WORLD)]
    failed = [e.read_text() for e in errors if e.exists()]
    assert not failed, f"{name} failed on a rank:\n" + "\n".join(failed)
    return [torch.load(out_dir / f"{name}.rank{r}.pt", weights_only=False) for r in range(WORLD)]


def close(mode, api, got, want, atol=ATOL, rtol=RTOL):
    """assert_close, recording the largest difference for the parity table."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            close(mode, api, got[key], want[key], atol, rtol)
        return
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            close(mode, api, g, w, atol, rtol)
        return
    got = got.float() if got.dtype == torch.bfloat16 else got
    difference = (got - want).abs().max().item() if got.numel() else 0.0
    PARITY[(mode, api)] = max(PARITY.get((mode, api), 0.0), difference)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_the_default_backend_is_neuron_over_gloo(ranks):
    """init_process_group() with no backend named, neuron the accelerator: the neuron
    backend, answering for neuron and cpu tensors."""
    mode, out_dir = ranks
    for rank in range(WORLD):
        backend = torch.load(out_dir / f"backend.rank{rank}.pt")
        assert backend["config"] == "neuron:neuron"
        assert sorted(backend["devices"]) == ["cpu", "neuron"]
        assert backend["mode"] == mode


def test_dtensor_placements_redistribute_and_training(ranks):
    mode = ranks[0]
    want = S.reference_dtensor(WORLD)
    for rank, got in enumerate(results(ranks, "dtensor")):
        for key, value in want.items():
            value = value[rank] if isinstance(value, list) else value
            close(mode, "DTensor", got[key], value)


def test_tensor_parallel_with_sequence_parallel_and_loss_parallel(ranks):
    mode = ranks[0]
    want = S.reference_tp(WORLD)
    for got in results(ranks, "tp"):
        close(mode, "TP", got["params"], want["params"])
        close(mode, "TP", got["loss"], want["loss"])


def test_tensor_parallel_collectives_are_counted_per_rank_with_bytes_and_time(ranks):
    for rank, got in enumerate(results(ranks, "tp")):
        stats = got["stats"]
        assert stats["rank"] == rank and stats["world_size"] == WORLD
        assert stats["collectives"] == sum(op["calls"] for op in stats["by_op"].values()) > 0
        assert stats["bytes"] > 0 and stats["time_us"] > 0
        # sequence parallel all-gathers activations and reduce-scatters them back
        ops = " ".join(stats["by_op"])
        assert "allgather" in ops and "reduce_scatter" in ops, ops


def test_fsdp2_resharding_both_ways_and_cpu_offload(ranks):
    mode = ranks[0]
    want = S.reference_fsdp2(WORLD)["params"]
    for got in results(ranks, "fsdp2"):
        close(mode, "FSDP2 reshard_after_forward=True", got["reshard"], want)
        close(mode, "FSDP2 reshard_after_forward=False", got["no_reshard"], want)
        close(mode, "FSDP2 CPUOffloadPolicy", got["offload"], want)
        assert got["offload_param_devices"] == ["cpu"]  # the sharded parameters live on the host


def test_fsdp2_bf16_mixed_precision(ranks):
    """bf16 parameters in forward and backward, fp32 gradient reduction and fp32 master
    weights: the reference is the same FSDP2 run by CPU PyTorch on a CPU mesh over the
    same processes (within 1e-5: the same bf16 roundings). Against fp32 single-process
    training the bound is bf16's: its 8-bit mantissa rounds each activation by up to
    2**-9 relative, so parameters after 3 steps of lr 0.1 agree to about 1e-2."""
    mode = ranks[0]
    fp32 = S.reference_fsdp2(WORLD)["params"]
    for got in results(ranks, "fsdp2"):
        close(mode, "FSDP2 bf16 vs CPU FSDP2 bf16", got["bf16_neuron"], got["bf16_cpu"])
        close(mode, "FSDP2 bf16 vs fp32 single process", got["bf16_neuron"], fp32, atol=1e-2, rtol=1e-2)
        assert all(p.dtype == torch.float32 for p in got["bf16_neuron"].values())  # fp32 master weights


def test_distributed_checkpoint_saves_and_loads_sharded_state(ranks):
    mode = ranks[0]
    want = S.reference_fsdp2(WORLD)["params"]
    for got in results(ranks, "checkpoint"):
        close(mode, "DCP", got["saved"], want)
        close(mode, "DCP", got["loaded"], got["saved"], atol=0, rtol=0)  # bit for bit
        close(mode, "DCP", got["fresh_after_step"], got["after_step"], atol=0, rtol=0)  # momentum restored
        assert got["local_shapes"]["0.weight"] == (16 // WORLD, 8)  # still sharded


def test_pipeline_parallel_gpipe_and_1f1b(ranks):
    mode = ranks[0]
    want = S.reference_pipeline(WORLD)
    got = results(ranks, "pipeline")
    for schedule in ("gpipe", "1f1b"):
        for rank in range(WORLD):
            close(mode, f"PP {schedule}", got[rank][schedule]["params"], want["stage_params"][rank])
        close(mode, f"PP {schedule}", got[1][schedule]["losses"], want["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True], ids=["strict", "adaptive"])
def test_fsdp_and_tensor_parallel_on_a_2d_mesh_of_4_ranks(adaptive, tmp_path):
    """FSDP2 over the mesh's "dp" dimension and ColwiseParallel/RowwiseParallel over "tp".
    Four processes: slow on a 2-core machine (each imports torch), so -m slow."""
    mode = "adaptive" if adaptive else "strict"
    mp.spawn(S.worker, args=(4, free_port(), adaptive, str(tmp_path), ("fsdp_tp",)), nprocs=4, join=True)
    want = S.reference_fsdp_tp(4)["params"]
    errors = [p.read_text() for p in tmp_path.glob("*.error")]
    assert not errors, "\n".join(errors)
    got = [torch.load(tmp_path / f"fsdp_tp.rank{r}.pt", weights_only=False) for r in range(4)]
    for r in got:
        close(mode, "FSDP2 + TP (2-D mesh, 4 ranks)", r["params"], want)


def test_zz_print_parity_table():
    """Not a check: the largest difference per API and mode (pytest -s shows it)."""
    for (mode, api), difference in sorted(PARITY.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"{api:45s} {mode:9s} {difference:.2e}")
