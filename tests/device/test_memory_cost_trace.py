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


def test_storages_book_when_made_and_free_when_dropped_with_no_python_finalizer():
    """The books are the C side's: a storage books its rounded bytes when it is made (one at a
    time, or a replay's all at once) and frees them when its last reference goes, with no
    ``__del__`` to run; a set that does not fit books nothing but the OOM. A replay's
    intermediates are cells alone, each freeing its own bytes, until Python asks for their
    storages (``wrap``), which then free them instead: never twice."""
    from adaptive_eager_device.memory.storage import MEMORY, DeviceStorage

    torch.neuron.synchronize()
    assert "__del__" not in vars(DeviceStorage) and "__init__" not in vars(DeviceStorage)
    books = lambda: (MEMORY.allocated, MEMORY.allocations, MEMORY.live_blocks, MEMORY.frees, MEMORY.ooms)  # noqa: E731
    allocated, allocations, live, frees, ooms = books()
    one = DeviceStorage((3,), (1,), torch.float32, 12)
    assert (one.nbytes, one.shape, one.stride, one.dtype, one.alive) == (512, (3,), (1,), torch.float32, True)
    # slots 1 and 3 escape (storages in the table), 0 and 2 are intermediates (cells)
    fresh = DeviceStorage.fresh_slots([(n, (256,), (1,), torch.float32, 1024, n % 2 == 1) for n in range(4)], 5)
    table = [None] * 5
    cells = fresh.allocate(table, CONFIG.hbm_bytes)
    assert books() == (allocated + 512 + 4096, allocations + 5, live + 5, frees, ooms)
    assert [type(t) is DeviceStorage for t in table] == [False, True, False, True, False]
    assert [table[n].materialize().shape for n in (1, 3)] == [torch.Size([256])] * 2
    assert table[1].alive and table[1].nbytes == 1024
    del cells  # the intermediates: no storage was made for them
    assert books() == (allocated + 512 + 2048, allocations + 5, live + 3, frees + 2, ooms)
    table = None
    assert books() == (allocated + 512, allocations + 5, live + 1, frees + 4, ooms)
    table = [None] * 5
    cells = fresh.allocate(table, CONFIG.hbm_bytes)
    cells.wrap(table)  # the records' path: every intermediate gets its storage, over its cell
    assert [type(t) is DeviceStorage for t in table] == [True, True, True, True, False]
    assert (table[0].shape, table[0].stride, table[0].dtype, table[0].nbytes, table[0].alive) == (
        (256,), (1,), torch.float32, 1024, False)
    del cells
    assert books() == (allocated + 512 + 4096, allocations + 9, live + 5, frees + 4, ooms)
    table = None
    assert books() == (allocated + 512, allocations + 9, live + 1, frees + 8, ooms)
    del one
    assert books() == (allocated, allocations + 9, live, frees + 9, ooms)
    too_big = DeviceStorage.fresh_slots([(0, (1,), (1,), torch.uint8, CONFIG.hbm_bytes - allocated + 512, False)], 1)
    assert too_big.allocate([None], CONFIG.hbm_bytes) is None  # nothing booked; the replay runs the FX code
    assert books() == (allocated, allocations + 9, live, frees + 9, ooms + 1)
    for bad in (lambda: DeviceStorage(("x",), (1,), torch.float32, 4),  # a layout C cannot read
                lambda: DeviceStorage.fresh_slots([(0, (1,), ("x",), torch.uint8, 512, False)], 1)):
        with pytest.raises(TypeError):
            bad()
        assert books() == (allocated, allocations + 9, live, frees + 9, ooms + 1)  # nothing booked, or given back


def test_a_storage_freed_while_an_error_propagates_leaves_the_error_alone():
    """A temporary dropped as the frame unwinds frees its storage while the exception is
    set: the free (device/csrc/memory.cpp) must neither clear nor replace it (it did: a
    SystemError, "error return without exception set")."""
    for _ in range(3):
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(2, device="neuron").to("neuron:2")


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


# The published figures the tests compute with (device/hardware/cost_model.py cites each):
TENSOR_HZ, VECTOR_HZ = 2.4e9, 0.96e9  # NeuronCore-v3 engine clocks
CHIP_HBM_BANDWIDTH = 2.9e12  # one Trn2 chip, shared by its 4 HBM stacks (assumption: evenly)
LNC2_BANDWIDTH = CHIP_HBM_BANDWIDTH / 4  # one stack: the two physical cores of a logical core


def test_device_profile_is_one_logical_neuroncore():
    """LNC=2 (default): two NeuronCore-v3 on one of the chip's four HBM stacks; LNC=1: one,
    sharing its stack with its neighbour. The TensorE peaks follow from the 128 x 128
    array at 2.4 GHz, matching AWS's per-core 79 BF16 / 20 FP32 TFLOPS to rounding."""
    two, one = DeviceProfile(), DeviceProfile(lnc=1)
    assert (two.lnc, two.physical_cores, two.logical_cores_per_chip) == (2, 2, 4)
    assert (one.physical_cores, one.logical_cores_per_chip) == (1, 8)
    assert two.hbm_bytes == 24 * (1 << 30) and one.hbm_bytes == 12 * (1 << 30)  # 96 GiB per chip
    assert two.hbm_bandwidth_bytes_per_s == 725e9 and one.hbm_bandwidth_bytes_per_s == 362.5e9
    # DMA: 16 engines x 23 B/ns per physical core (368 GB/s), capped by the HBM share
    assert two.dma_bytes_per_s == min(32 * 23e9, 725e9) == 725e9
    assert one.dma_bytes_per_s == min(16 * 23e9, 362.5e9) == 362.5e9
    assert two.sbuf_bytes == 2 * 28 * (1 << 20) and two.psum_bytes == 2 * 2 * (1 << 20)
    assert one.sbuf_bytes == 28 * (1 << 20) and one.psum_bytes == 2 * (1 << 20)
    for profile in (one, two):
        cores = profile.physical_cores
        assert profile.peak_bf16_flops == 2 * 128 * 128 * TENSOR_HZ * cores
        assert profile.peak_fp32_flops == profile.peak_bf16_flops / 4
        assert profile.peak_flops(torch.float8_e4m3fn) == 2 * profile.peak_bf16_flops
        assert abs(profile.peak_bf16_flops / cores / 79e12 - 1) < 0.01  # published per core: 79 TFLOPS BF16
        assert abs(profile.peak_fp32_flops / cores / 20e12 - 1) < 0.02  # and 20 TFLOPS FP32
    assert two.launch_overhead_us == 10.0  # an assumption, NEURON_SIM_LAUNCH_US


def test_the_default_profile_and_memory_are_the_logical_cores(any_mode):
    assert PROFILE.lnc == CONFIG.lnc == 2
    assert CONFIG.hbm_bytes == PROFILE.hbm_bytes == 24 * (1 << 30)  # NEURON_SIM_HBM_GB's default
    properties = torch.neuron.get_device_properties()
    assert properties.total_memory == torch.neuron.mem_get_info()[1] == 24 * (1 << 30)
    assert "LNC=2" in torch.neuron.get_device_name()


def test_lnc_1_from_the_environment():
    code = ("import torch; from adaptive_eager_device.hardware.cost_model import PROFILE; "
            "print(PROFILE.lnc, torch.neuron.mem_get_info()[1] >> 30, PROFILE.dma_bytes_per_s)")
    env = {**__import__("os").environ, "NEURON_SIM_LNC": "1"}
    env.pop("NEURON_SIM_HBM_GB", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "12", "362500000000.0"]


def test_the_engine_model_costs_instructions():
    """The API NKI instructions are costed with: cycles per instruction on one physical
    core, max(MIN_II = 64, N / lane rate); GpSimdE 150 + N; nc_matmul's published formula."""
    p = DeviceProfile()
    assert p.instruction_cycles("vector", 512, torch.float32) == 256  # 2 elements per lane per cycle
    assert p.instruction_cycles("vector", 512, torch.bfloat16) == 128  # 4 in BF16
    assert p.instruction_cycles("vector", 16, torch.float32) == 64  # MIN_II
    assert p.instruction_cycles("scalar", 512, torch.float32) == 512  # 128 elements per cycle
    assert p.instruction_cycles("gpsimd", 512, torch.float32) == 150 + 512
    assert p.instruction_time_us("scalar", 1200, torch.float32) == 1200 / 1.2e9 * 1e6
    assert p.nc_matmul_cycles(128, 512, torch.bfloat16) == 512
    assert p.nc_matmul_cycles(128, 512, torch.float32) == 4 * 512
    assert p.nc_matmul_cycles(128, 8, torch.bfloat16) == 64  # max(min(64, 128), 8)
    assert p.nc_matmul_cycles(16, 8, torch.bfloat16) == 16
    # a whole op spreads its elements over 128 lanes and both physical cores
    assert p.engine_time_us("vector", 128 * 2 * 1024, torch.float32) == 1024 / 2 / VECTOR_HZ * 1e6
    assert p.engine_time_us("vector", 128 * 1024, torch.float32, cores=1) == 1024 / 2 / VECTOR_HZ * 1e6
    assert p.dma_time_us(725e3) == 1.0 and p.dma_time_us(725e3, transfers=1) == 1.0 + 1.3
    with pytest.raises(ValueError, match="unknown engine"):
        p.instruction_cycles("sync", 1, torch.float32)


def kernel_times():
    return {name: v["time_us"] for name, v in adaptive_eager.stats()["kernels"].items()}


def matmul_cycles(m, k, n):
    """nc_matmul tiles of [m, k] @ [k, n] for 16-bit inputs, dimensions multiples of 128 and
    512: K and the stationary operand in tiles of 128, the moving one in tiles of 512 (each
    max(min(64, 128), 512) = 512 cycles)."""
    return (k // 128) * (m // 128) * (n // 512) * 512


def test_matmul_time_is_compute_bound_and_exact(strict_mode):
    a = torch.ones(512, 256, device="neuron")
    b = torch.ones(256, 1024, device="neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    (a @ b).sum().item()
    nbytes = (512 * 256 + 256 * 1024 + 512 * 1024) * 4
    tensor_us = 4 * matmul_cycles(512, 256, 1024) / 2 / TENSOR_HZ * 1e6  # FP32 costs 4x; two physical cores
    assert tensor_us > nbytes / LNC2_BANDWIDTH * 1e6  # compute-bound
    assert kernel_times()["aten::mm"] == round(10.0 + tensor_us, 3)


def test_a_float32_2048_cubed_matmul_and_a_64_mi_element_add_take_the_issues_figures(strict_mode):
    """Issue 33's two kernels, now one logical NeuronCore's: about 430 us (was 113 us on a
    whole chip's roofline) and about 1,100 us (was 288 us)."""
    a = torch.ones(2048, 2048, device="neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    (a @ a).sum().item()
    assert kernel_times()["aten::mm"] == round(10.0 + 4 * matmul_cycles(2048, 2048, 2048) / 2 / TENSOR_HZ * 1e6, 3)
    assert kernel_times()["aten::mm"] == 446.907
    x = torch.ones(64 << 20, device="neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    y = x + x
    torch.neuron.synchronize()
    nbytes = 3 * (64 << 20) * 4  # read two, write one: 768 MiB, memory-bound
    assert kernel_times()["aten::add"] == round(10.0 + nbytes / LNC2_BANDWIDTH * 1e6, 3) == 1120.767
    del x, y


def test_pointwise_time_is_memory_bound_and_exact(strict_mode):
    x = torch.ones(1 << 20, device="neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    (x + x).sum().item()
    nbytes = 3 * (1 << 20) * 4  # read two, write one
    vector_us = 2 * (1 << 20) / 128 / 2 / 2 / VECTOR_HZ * 1e6  # two inputs; 128 lanes x 2 per cycle; 2 cores
    assert vector_us < nbytes / LNC2_BANDWIDTH * 1e6
    assert kernel_times()["aten::add"] == round(10.0 + nbytes / LNC2_BANDWIDTH * 1e6, 3)
    stats = adaptive_eager.stats()
    assert stats["bytes_moved"] == nbytes + (1 << 20) * 4 + 4  # + the sum: read 4 MiB, write 4 B


def test_each_kind_of_op_runs_on_its_engine():
    """Matmuls on TensorE, transcendental activations on ScalarE, elementwise arithmetic and
    reductions on VectorE, index ops on GpSimdE, copies on the DMA queues only."""
    from adaptive_eager_device.hardware.cost_model import op_cost

    x = torch.empty(256, 256, device="meta")
    i = torch.zeros(256, dtype=torch.int64, device="meta")
    aten = torch.ops.aten
    cases = [
        (aten.mm.default, (x, x), "tensor"),
        (aten.exp.default, (x,), "scalar"),
        (aten.add.Tensor, (x, x), "vector"),
        (aten.sum.default, (x,), "vector"),
        (aten.index_select.default, (x, 0, i), "gpsimd"),
    ]
    for op, args, engine in cases:
        out = op(*args)
        cost = op_cost(op, args, {}, [out])
        assert cost.busiest_engine == engine, (op, cost)
        assert sum(us > 0 for us in cost.engine_us) == 1, (op, cost)
    copy = op_cost(aten.clone.default, (x,), {}, [x.clone()])
    assert copy.engine_us == (0.0, 0.0, 0.0, 0.0) and copy.time_us == 2 * 256 * 256 * 4 / LNC2_BANDWIDTH * 1e6


def test_bf16_runs_at_four_times_the_fp32_rate(strict_mode):
    # 1024: TensorE-bound in both dtypes (bf16: 13.7 us of TensorE against 8.7 us of DMA),
    # and a CPU bf16 matmul 8x cheaper than at 2048
    for dtype, factor in ((torch.float32, 4), (torch.bfloat16, 1)):
        a = torch.ones(1024, 1024, dtype=dtype, device="neuron")
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        (a @ a).sum().item()
        expected = 10.0 + factor * matmul_cycles(1024, 1024, 1024) / 2 / TENSOR_HZ * 1e6
        assert kernel_times()["aten::mm"] == round(expected, 3)


def test_the_launch_overhead_is_added_when_a_launch_is_accounted(strict_mode):
    """A cached op cost holds no launch overhead: the queue adds NEURON_SIM_LAUNCH_US per
    launch, read live, so a change applies to a signature already costed."""
    x = torch.ones(1 << 10, device="neuron")
    times = []
    for launch_us in (10.0, 25.0):
        CONFIG.launch_us = launch_us
        try:
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            (x * 3).sum().item()  # the same two signatures, costed once
            times.append(kernel_times()["aten::mul"])
        finally:
            CONFIG.launch_us = 10.0
    assert times[1] - times[0] == pytest.approx(15.0, abs=1e-9)


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
        assert e["ts"] >= clock - 0.0015 and e["dur"] >= 10.0  # (each rounded to the trace's 1 ns)
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
