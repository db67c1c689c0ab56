"""torch.distributed on neuron tensors: collectives and point-to-point send/recv through
gloo on the CPU bytes, DDP with two processes on 127.0.0.1 (mp.spawn and torchrun),
failure handling, and what FSDP2 does today. Every run is bounded in time.

The collectives, DDP and FSDP2 scenarios of one mode run one after another in one pair of
rank processes (the module fixture ``ranks``), as tests/integrations/test_distributed_apis.py
does: starting the processes (``import torch`` in each) is most of their cost. Each
scenario's result, or the traceback of its failure, is written per rank, so one broken
scenario fails its own test and hides nothing else."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port, adaptive, timeout_s=60):
    import datetime

    import torch.distributed as dist

    import adaptive_eager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    adaptive_eager.enable() if adaptive else adaptive_eager.disable()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return dist


def _scenarios(rank, world, port, adaptive, out_dir):
    """One rank: the process group once, then each scenario in its own folder, with the
    statistics zeroed before it; a scenario that raises leaves its traceback and the next
    one runs (a rank that died mid-collective would time the others out instead)."""
    import adaptive_eager

    dist = _init(rank, world, port, adaptive)
    for name, scenario in SCENARIOS.items():
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        adaptive_eager.reset_stats()
        try:
            scenario(rank, world, folder)
        except Exception:
            with open(os.path.join(folder, f"rank{rank}.error"), "w") as handle:
                handle.write(traceback.format_exc())
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[False, True], ids=["strict", "adaptive"])
def ranks(request, tmp_path_factory):
    """Two ranks of one mode that ran every scenario of :data:`SCENARIOS`."""
    out_dir = tmp_path_factory.mktemp("ranks_adaptive" if request.param else "ranks_strict")
    mp.spawn(_scenarios, args=(2, free_port(), request.param, str(out_dir)), nprocs=2, join=True)
    return out_dir


def scenario_dir(out_dir, name):
    """The folder of one scenario's results, after checking that no rank failed it."""
    folder = out_dir / name
    failed = [e.read_text() for e in sorted(folder.glob("rank*.error"))]
    assert not failed, f"{name} failed on a rank:\n" + "\n".join(failed)
    return folder


def _collectives(rank, world, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import adaptive_eager

    results = {}
    x = torch.full((4,), float(rank + 1), device="neuron") * 2  # queued work before the collective
    dist.all_reduce(x)
    results["all_reduce"] = x.cpu().tolist()
    b = torch.full((3,), float(rank), device="neuron")
    dist.broadcast(b, src=1)
    results["broadcast"] = b.cpu().tolist()
    gathered = [torch.empty(2, device="neuron") for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device="neuron"))
    results["all_gather"] = [t.cpu().tolist() for t in gathered]
    flat = torch.empty(2 * world, device="neuron")
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank + 10), device="neuron"))
    results["all_gather_into_tensor"] = flat.cpu().tolist()
    shard = torch.empty(2, device="neuron")
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * world, device="neuron") + rank)
    results["reduce_scatter_tensor"] = shard.cpu().tolist()
    work = dist.all_reduce(y := torch.ones(2, device="neuron") * (rank + 1), async_op=True)
    work.wait()
    results["async_all_reduce"] = y.cpu().tolist()
    dist.barrier()
    # point-to-point: blocking, async, and from any source, with queued work on both sides
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.arange(4.0, device="neuron") * 3, dst=peer)
        got = torch.zeros(2, device="neuron")
        request = dist.irecv(got, src=peer)
        request.wait()
        results["irecv"] = (got + 1).cpu().tolist()
        anywhere = torch.zeros(3, device="neuron")
        results["recv_source"] = dist.recv(anywhere)
        results["recv_any"] = anywhere.cpu().tolist()
    else:
        got = torch.zeros(4, device="neuron") - 1
        dist.recv(got, src=peer)
        results["recv"] = (got * 2).cpu().tolist()
        dist.isend(torch.full((2,), 5.0, device="neuron"), dst=peer).wait()
        dist.send(torch.arange(3.0, device="neuron") + 7, dst=peer)
    results["mesh"] = str(init_device_mesh("neuron", (world,)))
    stats = adaptive_eager.stats()
    results["collectives"] = stats["collectives"]
    results["fallback_ops"] = stats["fallback_ops"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)


def test_collectives_on_neuron_tensors(ranks):
    out_dir = scenario_dir(ranks, "collectives")
    r0, r1 = (json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["all_reduce"] == [6.0] * 4  # (1 + 2) * 2
        assert r["broadcast"] == [1.0] * 3
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["all_gather_into_tensor"] == [10.0, 10.0, 11.0, 11.0]
        assert r["async_all_reduce"] == [3.0, 3.0]
        assert r["mesh"] == "DeviceMesh((2,), 'neuron', stride=(1,))"
        assert r["fallback_ops"] == {}  # collectives are collectives, not CPU fallbacks
        assert r["collectives"]["c10d::allreduce_"] == 2
    assert r0["reduce_scatter_tensor"] == [1.0, 3.0]  # (0,1)+(1,2)
    assert r1["reduce_scatter_tensor"] == [5.0, 7.0]
    assert r1["recv"] == [0.0, 6.0, 12.0, 18.0]
    assert r0["irecv"] == [6.0, 6.0]
    assert r0["recv_source"] == 1 and r0["recv_any"] == [7.0, 8.0, 9.0]
    assert r0["collectives"]["c10d::send"] == 1 and r1["collectives"]["c10d::send"] == 2


def _ddp(rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to("neuron")
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data, target = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 2)
    for _ in range(3):
        shard = slice(rank * 4, (rank + 1) * 4)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(data[shard].to("neuron")), target[shard].to("neuron")).backward()
        optimizer.step()
    torch.save([p.detach().cpu() for p in model.parameters()], os.path.join(out_dir, f"rank{rank}.pt"))
    torch.save((data, target), os.path.join(out_dir, "data.pt"))


def single_process_reference(data, target):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data), target).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_ddp_matches_single_process_training_on_the_whole_batch(ranks):
    out_dir = scenario_dir(ranks, "ddp")
    data, target = torch.load(out_dir / "data.pt")
    expected = single_process_reference(data, target)
    for rank in range(2):
        for got, want in zip(torch.load(out_dir / f"rank{rank}.pt"), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("neuron")
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.arange(8.0).view(2, 4)[rank : rank + 1].to("neuron")
    model(x).sum().backward()
    optimizer.step()
    weight = [round(v, 6) for v in model.module.weight.detach().cpu().flatten().tolist()]
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.txt"), "w") as handle:
        handle.write(str(weight))  # one file per rank: the ranks' stdout lines can interleave
    dist.destroy_process_group()
    """
)


def test_ddp_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    env = dict(os.environ, NEURON_ADAPTIVE_EAGER="1", OMP_NUM_THREADS="1", OUT_DIR=str(tmp_path))
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert weights[0] == weights[1]  # replicas agree
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    (reference(torch.arange(8.0).view(2, 4)).sum() / 2).backward()  # DDP averages gradients
    with torch.no_grad():
        reference.weight -= 0.5 * reference.weight.grad
    assert weights[0] == str([round(v, 6) for v in reference.weight.flatten().tolist()])


def _failing(rank, world, port, out_dir):
    dist = _init(rank, world, port, adaptive=False, timeout_s=20)
    if rank == 1:
        raise RuntimeError("rank 1 fails before the collective")
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2, device="neuron"))
        outcome = "no error"
    except Exception as error:  # gloo reports the lost peer
        outcome = f"{type(error).__name__}: {error}"
    with open(os.path.join(out_dir, "rank0.txt"), "w") as handle:
        handle.write(f"{time.monotonic() - started:.1f}\n{outcome}")


def test_a_failing_rank_gives_the_others_a_clear_error_not_a_hang(tmp_path):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_failing, args=(rank, 2, port, str(tmp_path))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=90)
        assert not process.is_alive(), "a rank hung"
    assert processes[1].exitcode != 0  # the failing rank failed
    elapsed, outcome = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert outcome != "no error", outcome
    assert float(elapsed) < 30, f"rank 0 waited {elapsed} s: {outcome}"


def _fsdp(rank, world, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("neuron", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to("neuron")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, target = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 2)
    for _ in range(3):
        shard = slice(rank * 4, (rank + 1) * 4)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data[shard].to("neuron")), target[shard].to("neuron")).backward()
        optimizer.step()
    full = [p.full_tensor().detach().cpu() for p in model.parameters()]
    torch.save(full, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.save((data, target), os.path.join(out_dir, "data.pt"))


def test_fsdp2_trains_like_a_single_process(ranks):
    """FSDP2 (fully_shard) over a neuron mesh: DTensor propagates shardings on FakeTensors
    of the neuron parameters, and frees and refills their storages with resize_."""
    out_dir = scenario_dir(ranks, "fsdp2")
    data, target = torch.load(out_dir / "data.pt")
    expected = single_process_reference(data, target)
    for rank in range(2):
        for got, want in zip(torch.load(out_dir / f"rank{rank}.pt"), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# The scenarios the ranks of one mode run, in this order (test_collectives_on_neuron_tensors
# counts collectives from zero: statistics are reset before each).
SCENARIOS = {"collectives": _collectives, "ddp": _ddp, "fsdp2": _fsdp}
