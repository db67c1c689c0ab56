"""Device memory accounting, the cost model's exact figures, and the timeline file."""
import json
import subprocess
import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager_device.hardware import trace
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware.cost_model import PROFILE, DeviceProfile

MIB = 1 << 20


# -- memory ---------------------------------------------------------------------------


def test_memory_stats_summary_and_empty_cache(any_mode):
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    x = torch.empty(256 * 1024, device="neuron")  # 1 MiB
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + MIB
    assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
    assert "allocated" in torch.neuron.memory_summary()
    del x
    assert torch.neuron.memory_allocated() == base
    assert torch.neuron.memory_reserved() >= base + MIB  # cached, as CUDA's allocator
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == base


def test_out_of_memory_raises_at_allocation_and_loses_nothing(any_mode):
    keep = torch.arange(1000.0, device="neuron")
    saved = CONFIG.hbm_bytes
    CONFIG.hbm_bytes = torch.neuron.memory_allocated() + 4 * MIB
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"(?s)out of device memory.*allocated in \d+ blocks"):
            torch.empty(2 * 1024 * 1024, device="neuron")  # 8 MiB
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(1024, 1024, 2, device="neuron") @ torch.ones(2, 1024, device="neuron")
        small = keep * 2  # what fits still works
    finally:
        CONFIG.hbm_bytes = saved
    assert keep.sum().item() == sum(range(1000))
    assert small[-1].item() == 1998.0
    assert torch.neuron.memory_stats()["num_ooms"] >= 2


OOM_IN_BACKWARD = """
import torch, adaptive_eager
x = torch.randn(1024, 1024, device="neuron", requires_grad=True)  # 4 MiB each
y = x.sin().sin().sin()
try:
    y.sum().backward()  # the gradient chain does not fit
except torch.OutOfMemoryError as error:
    print("raised:", str(error).splitlines()[0].split(".")[0], error.__traceback__.tb_frame.f_code.co_filename)
torch.neuron.synchronize()  # the kernels queued before the error free what they read
del y
x.grad = None
(x * 2).sum().backward()
print("recovered:", x.grad[0, 0].item(), x.grad.shape == x.shape)
"""


@pytest.mark.parametrize("adaptive", ["0", "1"], ids=["strict", "adaptive"])
def test_out_of_memory_inside_backward_raises_from_backward_as_on_the_cpu(adaptive):
    # The device guard is C++, so an error leaving a device op on the autograd engine's
    # thread reaches backward()'s caller, as on the CPU, and the device keeps working.
    env = {**__import__("os").environ, "NEURON_SIM_HBM_GB": "0.02", "NEURON_ADAPTIVE_EAGER": adaptive}
    done = subprocess.run([sys.executable, "-c", OOM_IN_BACKWARD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "raised: neuron: out of device memory <string>", lines
    assert lines[1] == "recovered: 2.0 True"


def test_capacity_from_the_environment():
    code = "import torch; print(torch.neuron.mem_get_info()[1])"
    env = {**__import__("os").environ, "NEURON_SIM_HBM_GB": "0.5"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == 512 * MIB


# -- cost model -----------------------------------------------------------------------


def test_device_profile_defaults_are_one_trainium2_chip():
    profile = DeviceProfile()
    assert profile.hbm_bytes == 96 * (1 << 30)
    assert profile.hbm_bandwidth_bytes_per_s == 2.9e12
    assert profile.peak_bf16_flops == 667e12
    assert profile.peak_fp32_flops == 667e12 / 4
    assert profile.launch_overhead_us == 10.0


def kernel_times():
    return {name: v["time_us"] for name, v in adaptive_eager.stats()["kernels"].items()}


def test_matmul_time_is_compute_bound_and_exact(strict_mode):
    a = torch.ones(512, 256, device="neuron")
    b = torch.ones(256, 1024, device="neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    (a @ b).sum().item()
    flops = 2 * 512 * 256 * 1024
    nbytes = (512 * 256 + 256 * 1024 + 512 * 1024) * 4
    expected = 10.0 + max(flops / PROFILE.peak_fp32_flops, nbytes / 2.9e12) * 1e6
    assert flops / PROFILE.peak_fp32_flops > nbytes / 2.9e12  # compute-bound
    assert kernel_times()["aten::mm"] == round(expected, 3)


def test_pointwise_time_is_memory_bound_and_exact(strict_mode):
    x = torch.ones(1 << 20, device="neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    (x + x).sum().item()
    nbytes = 3 * (1 << 20) * 4  # read two, write one
    assert kernel_times()["aten::add"] == round(10.0 + nbytes / 2.9e12 * 1e6, 3)
    stats = adaptive_eager.stats()
    assert stats["bytes_moved"] == nbytes + (1 << 20) * 4 + 4  # + the sum: read 4 MiB, write 4 B


def test_bf16_runs_at_four_times_the_fp32_rate(strict_mode):
    for dtype, peak in ((torch.float32, PROFILE.peak_fp32_flops), (torch.bfloat16, PROFILE.peak_bf16_flops)):
        a = torch.ones(2048, 2048, dtype=dtype, device="neuron")
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        (a @ a).sum().item()
        assert kernel_times()["aten::mm"] == round(10.0 + 2 * 2048**3 / peak * 1e6, 3)


# -- timeline ---------------------------------------------------------------------------


def test_trace_links_host_ops_to_device_kernels_per_stream(tmp_path, strict_mode):
    path = tmp_path / "trace.json"
    trace.start()
    s = torch.neuron.Stream()
    x = torch.ones(8, device="neuron")
    with torch.neuron.stream(s):
        y = (x * 2).relu()
    y.sum().item()
    trace.stop(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    host = [e for e in slices if e["pid"] == trace.HOST_PID]
    worker = [e for e in slices if e["pid"] == trace.WORKER_PID]
    simulated = [e for e in slices if e["pid"] == trace.SIMULATED_PID]
    assert [e["name"] for e in host] == ["aten::ones", "aten::mul", "aten::relu", "aten::sum"]
    assert [e["name"] for e in simulated] == [e["name"] for e in host]
    assert sorted(e["name"] for e in worker) == sorted(e["name"] for e in host)
    # the simulated queue runs kernels one after another, none before it is issued
    clock = 0.0
    for e in simulated:
        assert e["ts"] >= clock - 1e-6 and e["dur"] >= 10.0
        clock = e["ts"] + e["dur"]
    # one flow arrow per op, from its issue to its kernel's execution
    starts = {e["id"] for e in events if e["ph"] == "s"}
    finishes = {e["id"] for e in events if e["ph"] == "f"}
    assert starts == finishes and len(starts) == 4
    # marked per stream
    assert {e["tid"] for e in simulated} == {0, s.stream_id}
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"host", "neuron:0 worker (real time)", "neuron:0 (simulated time)", f"stream {s.stream_id}"} <= names


def test_trace_from_the_environment(tmp_path):
    path = tmp_path / "env_trace.json"
    code = "import torch; (torch.ones(4, device='neuron') + 1).cpu()"
    env = {**__import__("os").environ, "NEURON_TRACE": str(path), "NEURON_ADAPTIVE_EAGER": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X" and e["pid"] == trace.SIMULATED_PID) == 2


def test_kernels_appear_in_torch_profiler_on_the_device_lane_not_on_the_worker(strict_mode):
    """The device worker no longer wraps kernels in ``neuron::`` ranges (they needed
    profile_all_threads): the kernels are device events (tests/device/test_profiler.py)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity

    x = torch.ones(4, device="neuron")
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
                                experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        (x * 3).cpu()
    names = [(e.name, e.device_type) for e in prof.events()]
    assert ("aten::mul", torch.autograd.DeviceType.PrivateUse1) in names
    assert not any(name.startswith("neuron::aten") for name, _ in names)
