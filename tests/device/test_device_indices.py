"""Device indices: a process sees several neuron devices, as on a Trainium host where
every NeuronCore is visible to every process (device/memory/indices.py).

The count is fixed at import (the C++ hooks hold it), so the checks with two devices run
in a subprocess started with ``LOCAL_WORLD_SIZE=2`` (what torchrun sets), in both modes,
and compare with the same computation on the CPU here. A 2-process torchrun launch of an
Accelerate training step (Accelerate's DDP wraps with ``device_ids=[local_rank]``, so
rank 1 runs on ``neuron:1``) is compared with single-process CPU training on the whole
batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from adaptive_eager_device.core.config import DeviceConfig

TIMEOUT_S = 120

# Runs with two devices. Prints one JSON line: devices and values (as lists) to compare.
TWO_DEVICES = textwrap.dedent('''
    import json, traceback
    import torch

    out = {}
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return [plain(v) for v in value] if isinstance(value, list) else value

    def record(name, value):
        out[name] = plain(value)

    record("count", [torch.neuron.device_count(), torch.accelerator.device_count()])
    record("current", torch.neuron.current_device())
    torch.manual_seed(0)
    a, w, b = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    x = a.to("neuron:1")
    y = torch.relu(x @ w.to("neuron:1") + b.to("neuron:1")).sum(0)
    record("devices", [str(x.device), str(x.untyped_storage().device), str(y.device)])
    record("y", y.cpu())
    z = y.to("neuron:0")  # a device copy between indices
    record("copy_device", str(z.device))
    record("copy", (z * 2).cpu())
    dst = torch.zeros(5, device="neuron:0")
    dst.copy_(y)
    record("copy_", dst.cpu())

    with torch.neuron.device(1):
        inside = [torch.neuron.current_device(), torch.accelerator.current_device_index(),
                  str(torch.ones(2, device="neuron").device), str(torch.zeros(2, device="neuron:0").device)]
    record("guard", inside + [torch.neuron.current_device()])
    torch.accelerator.set_device_index(1)
    record("set_index", [torch.neuron.current_device(), str(torch.empty(1, device="neuron").device)])
    torch.neuron.set_device(0)
    record("set_device", torch.neuron.current_device())

    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, 0.5)
    torch.nn.init.constant_(model.bias, -0.25)
    model.to("neuron:1")
    loss = torch.tanh(model(x)).pow(2).sum()
    loss.backward()
    record("grad_devices", [str(model.weight.grad.device), str(model.bias.grad.device)])
    record("grads", [model.weight.grad.cpu(), model.bias.grad.cpu()])

    g = torch.Generator(device="neuron:1")
    g.manual_seed(7)
    drawn = torch.randn(6, generator=g, device="neuron:1")
    record("generator", [str(g.device), str(drawn.device)])
    record("drawn", drawn.cpu())

    s = torch.neuron.Stream(device="neuron:1")
    with torch.neuron.stream(s):  # makes neuron:1 current, as torch.cuda.stream does
        on_stream = y * 3
        made = torch.ones(1, device="neuron")
        event = torch.neuron.Event()
        event.record()
    record("streams", [s.device_index, torch.neuron.default_stream(1).device_index,
                       torch.accelerator.current_stream(1).device_index, str(on_stream.device), str(made.device),
                       torch.neuron.current_device(), str(event.device)])
    record("on_stream", on_stream.cpu())
    record("memory", [torch.neuron.memory_allocated(0), torch.neuron.memory_allocated(1)])

    def error_of(call):
        try:
            call()
        except Exception as error:  # what the user sees: the message and the line raising it
            return [type(error).__name__, str(error), traceback.extract_tb(error.__traceback__)[-1].line]
        return None

    record("mixed", error_of(lambda: z + y))
    record("mixed_inplace", error_of(lambda: z.add_(y)))
    record("ordinal", error_of(lambda: torch.ones(2, device="neuron:2")))
    record("ordinal_to", error_of(lambda: y.to("neuron:5")))
    record("ordinal_set", error_of(lambda: torch.neuron.set_device(2)))
    print(json.dumps(out))
''')


def _run_two_devices(adaptive: bool, directory) -> dict:
    script = directory / "two_devices.py"  # a file, so tracebacks show the source lines
    script.write_text(TWO_DEVICES)
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", NEURON_ADAPTIVE_EAGER="1" if adaptive else "0")
    env.pop("LOCAL_RANK", None)
    env.pop("NEURON_SIM_CORES", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["strict", "adaptive"])
def two_devices(request, tmp_path_factory):
    return _run_two_devices(request.param == "adaptive", tmp_path_factory.mktemp(request.param))


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-6, rtol=1e-6)


def test_the_count_is_the_local_world_size_and_every_index_holds_tensors(two_devices):
    got = two_devices
    assert got["count"] == [2, 2]
    assert got["current"] == 0  # no LOCAL_RANK: neuron:0
    assert got["devices"] == ["neuron:1"] * 3
    torch.manual_seed(0)
    a, w, b = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    y = torch.relu(a @ w + b).sum(0)
    _close(got["y"], y)
    assert got["copy_device"] == "neuron:0"
    _close(got["copy"], y * 2)
    _close(got["copy_"], y)


def test_the_device_guard_carries_the_index(two_devices):
    assert two_devices["guard"] == [1, 1, "neuron:1", "neuron:0", 0]
    assert two_devices["set_index"] == [1, "neuron:1"]
    assert two_devices["set_device"] == 0


def test_autograd_generators_and_streams_on_neuron_1(two_devices):
    got = two_devices
    torch.manual_seed(0)
    a, w, b = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, 0.5)
    torch.nn.init.constant_(model.bias, -0.25)
    torch.tanh(model(a)).pow(2).sum().backward()
    assert got["grad_devices"] == ["neuron:1", "neuron:1"]
    _close(got["grads"][0], model.weight.grad)
    _close(got["grads"][1], model.bias.grad)
    assert got["generator"] == ["neuron:1", "neuron:1"]
    _close(got["drawn"], torch.randn(6, generator=torch.Generator().manual_seed(7)))
    assert got["streams"] == [1, 1, 1, "neuron:1", "neuron:1", 0, "neuron:1"]
    _close(got["on_stream"], torch.relu(a @ w + b).sum(0) * 3)
    assert all(isinstance(m, int) and m >= 0 for m in got["memory"])


def test_mixing_indices_raises_as_cuda_does_at_the_users_line(two_devices):
    for name, line in (("mixed", "z + y"), ("mixed_inplace", "z.add_(y)")):
        kind, message, where = two_devices[name]
        assert kind == "DeviceMismatchError", (name, kind)
        assert ("Expected all tensors to be on the same device, but found at least two devices, "
                "neuron:0 and neuron:1!") in message
        assert "aten::add" in message
        assert line in where, (name, where)


def test_an_index_past_the_count_is_an_invalid_ordinal(two_devices):
    for name, device in (("ordinal", "neuron:2"), ("ordinal_to", "neuron:5"), ("ordinal_set", "neuron:2")):
        kind, message, _ = two_devices[name]
        assert kind == "RuntimeError"
        assert f"invalid device ordinal: {device} does not exist; the neuron device count is 2" in message


def test_the_count_and_the_first_device_come_from_the_configuration():
    assert DeviceConfig({}).device_count == 1
    torchrun = DeviceConfig({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    assert (torchrun.device_count, torchrun.initial_device, torchrun.errors) == (4, 3, [])
    override = DeviceConfig({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3", "NEURON_SIM_CORES": "2"})
    assert (override.device_count, override.initial_device) == (2, 0)  # rank 3 is not a device: neuron:0
    for bad in ("0", "two", "65"):
        config = DeviceConfig({"NEURON_SIM_CORES": bad})
        assert config.device_count == 1
        assert config.problem().startswith(f"NEURON_SIM_CORES={bad!r} is not valid"), config.problem()


# -- Accelerate under torchrun -----------------------------------------------------------

ACCELERATE = textwrap.dedent('''
    import json, sys
    import torch
    from accelerate import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.randn(8 * acc.num_processes, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = data[8 * acc.process_index: 8 * (acc.process_index + 1)].to(acc.device)
    loss = model(x).sum()
    acc.backward(loss)
    opt.step()
    params = [p.detach().cpu().tolist() for p in model.parameters()]
    with open(f"rank{acc.process_index}.json", "w") as out:  # a file each: the ranks' stdout interleaves
        json.dump({"rank": acc.process_index, "device": str(acc.device), "loss": loss.item(),
                   "param_device": str(next(model.parameters()).device), "params": params}, out)
''')


def test_accelerate_ddp_under_torchrun_equals_cpu_training(tmp_path):
    script = tmp_path / "acc.py"
    script.write_text(ACCELERATE)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "NEURON_SIM_CORES")}
    done = subprocess.run(
        # --standalone: torchrun binds a free port itself (a port picked here could be taken
        # before torchrun binds it)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["device"] for r in results] == ["neuron:0", "neuron:1"]
    assert [r["param_device"] for r in results] == ["neuron:0", "neuron:1"]

    torch.manual_seed(0)  # the same step on the CPU, one process, the whole batch
    model = torch.nn.Linear(4, 2)
    data = torch.randn(16, 4)
    losses = [model(data[:8]).sum(), model(data[8:]).sum()]
    ((losses[0] + losses[1]) / 2).backward()  # DDP averages the ranks' gradients
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(losses[rank].item(), abs=1e-5)
        for got, want in zip(result["params"], model.parameters()):
            torch.testing.assert_close(torch.tensor(got), want.detach(), atol=1e-6, rtol=1e-6)
