"""``torch.profiler`` sees the device as it sees a GPU (issue 31; device/csrc/profiler.cpp,
device/hardware/profiler.py): with ``ProfilerActivity.PrivateUse1``, one device event per
kernel launched in the region (as many as ``stats()["kernels_launched"]`` counts), named as
the statistics name it, with the cost model's duration; a flow from each op to the kernel
that ran it; device time per aten op and per ``record_function`` range in
``key_averages()``; in strict, adaptive and compiled mode, with a schedule and
``tensorboard_trace_handler``, and device memory events with ``profile_memory``."""
from __future__ import annotations

import collections
import glob
import json
import os
import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

import adaptive_eager
from adaptive_eager_device import _C
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware import profiler as device_profiler
from adaptive_eager_device.hardware.execution_queue import QUEUE

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
DEVICE = torch.autograd.DeviceType.PrivateUse1
CPU = torch.autograd.DeviceType.CPU


@pytest.fixture(params=["strict", "adaptive", "compiled"])
def mode(request):
    """Strict eager, adaptive eager, and a torch.compile(backend="neuron") model (its calls
    replay after the first, under the profiler too)."""
    torch._dynamo.reset()
    adaptive_eager.enable() if request.param == "adaptive" else adaptive_eager.disable()
    yield request.param
    torch._dynamo.reset()


def _training_step(mode, backward=True):
    """A small model's training step ending with a sync, warmed up (compiled graphs
    recorded: a profiled call replays; caches full); ``backward=False``: its forward only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("neuron")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model, backend="neuron") if mode == "compiled" else model
    x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")

    def step():
        with record_function("forward"):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        if backward:
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer_step"):
                optimizer.step()
                optimizer.zero_grad()
        torch.neuron.synchronize()

    for _ in range(2):
        step()
    return step


def _profiled(region, **options):
    """Profile ``region()`` (which ends with a sync point): (profile, stats of the region)."""
    adaptive_eager.reset_stats()
    with profile(activities=ACTIVITIES, **options) as prof:
        region()
    return prof, adaptive_eager.stats()


def _kernels(prof):
    """The device's kernel events (the per-op shares of fused kernels are user annotations)."""
    return [e for e in prof.events() if e.device_type == DEVICE and not e.is_user_annotation]


def _trace(prof, tmp_path, name="trace.json"):
    path = tmp_path / name
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def _near(a, b, count=1):
    """Equal up to the trace's nanosecond rounding of each of ``count`` kernels."""
    return abs(a - b) <= 0.001 * max(count, 1) + 1e-6


def test_one_device_event_per_launch_named_and_timed_as_the_statistics(mode):
    step = _training_step(mode)
    prof, stats = _profiled(step)
    kernels = _kernels(prof)
    assert len(kernels) == stats["kernels_launched"] > 0
    by_name = collections.defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.time_range.elapsed_us())
    assert set(by_name) == set(stats["kernels"])
    for name, figures in stats["kernels"].items():
        assert len(by_name[name]) == figures["launches"]
        assert _near(sum(by_name[name]), figures["time_us"], figures["launches"]), name
    if mode == "compiled":
        assert stats["compiled"]["replays"] == 2 and not stats["compiled"]["replay_fallbacks"]


def test_kernels_on_a_device_lane_in_queue_order_with_a_flow_from_every_op(mode, tmp_path):
    step = _training_step(mode)
    prof, stats = _profiled(step)
    events = _trace(prof, tmp_path)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["args"]["queue sequence"])
    assert len(kernels) == stats["kernels_launched"]
    assert {e["pid"] for e in kernels} == {0}  # the device lane: a process of its own...
    assert any(e.get("ph") == "M" and e["pid"] == 0 and e["args"].get("name") == "neuron" for e in events)
    for before, after in zip(kernels, kernels[1:]):  # ...in queue order, one after the other
        assert after["ts"] >= before["ts"] + before["dur"] - 0.002
    starts = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "f"}
    # one flow per op that reached the device, from where it was issued to its kernel
    assert len(starts) == stats["ops_recorded"] and starts.keys() == ends.keys()
    for flow, start in starts.items():
        assert ends[flow]["pid"] == 0 and ends[flow]["ts"] >= start["ts"]
    fused = [e for e in kernels if e["args"]["ops"] > 1]
    assert bool(fused) == (mode != "strict")
    shares = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    assert len(shares) == sum(e["args"]["ops"] for e in fused)  # fused kernels: a flow from each op
    assert any(e.get("name") == "neuron::synchronize" for e in events)


def test_an_ops_device_time_is_its_kernels_or_its_share_of_a_fused_kernel(mode, monkeypatch):
    """Strict: an op's device time is its kernel's, the cost model's time for the op.
    Adaptive, and compiled graphs running their FX code (a template's recording call, or
    NEURON_COMPILED_REPLAY=0): an op's share of its fused kernel, in proportion to the ops'
    own times."""
    x = torch.randn(1024, 1024, device="neuron")  # 4 MiB: the ops' own times differ (a reduction reads less)

    def chain(x):
        return ((x * 2 + 1).relu() - 0.5).abs().sum()

    run = torch.compile(chain, backend="neuron") if mode == "compiled" else chain

    def region():
        run(x)
        torch.neuron.synchronize()

    region()
    adaptive_eager.disable()  # each op's own kernel: the cost model's time for the op
    own, strict = _profiled(lambda: (chain(x), torch.neuron.synchronize()))
    own_time = {e.key: e.self_device_time_total for e in own.key_averages() if e.device_type == CPU
                and e.key.startswith("aten::") and e.self_device_time_total > 0}
    assert set(own_time) == {"aten::mul", "aten::add", "aten::relu", "aten::sub", "aten::abs", "aten::sum"}
    assert own_time["aten::sum"] < own_time["aten::mul"] - 0.1
    for name, time_us in own_time.items():
        assert _near(time_us, strict["kernels"][name]["time_us"])
    if mode == "adaptive":
        adaptive_eager.enable()
    if mode == "strict":
        return
    if mode == "compiled":
        monkeypatch.setattr(CONFIG, "compiled_replay", False)  # the FX code's aten ops run
    prof, stats = _profiled(region)
    (kernel_name,) = stats["kernels"]
    kernel_us = stats["kernels"][kernel_name]["time_us"]
    shares = {e.key: e.self_device_time_total for e in prof.key_averages() if e.device_type == CPU
              and e.self_device_time_total > 0}
    assert set(shares) == set(own_time)
    # the kernel's time, split by the ops' own cost-model times (without the launch overhead,
    # which is the kernel's, not an op's)
    work = {name: time_us - CONFIG.launch_us for name, time_us in own_time.items()}
    total = sum(work.values())
    for name, time_us in work.items():
        assert _near(shares[name], kernel_us * time_us / total, 2), name
    assert _near(sum(shares.values()), kernel_us, len(shares))


def test_a_record_function_range_gets_its_kernels_device_time(mode):
    forward = _training_step(mode, backward=False)  # every op of the region inside "forward"
    prof, stats = _profiled(forward)
    averages = {e.key: e for e in prof.key_averages() if e.device_type == CPU}
    assert stats["device_time_us"] > 0
    assert _near(averages["forward"].device_time_total, stats["device_time_us"], stats["kernels_launched"])


def test_each_kernel_is_attributed_once(mode):
    """The ops' self device times add up to the device's total (a fused kernel's time is
    split among its ops, not counted for each)."""
    step = _training_step(mode)
    prof, stats = _profiled(step)
    attributed = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == CPU)
    assert _near(attributed, stats["device_time_us"], stats["kernels_launched"])


def test_a_replayed_compiled_call_gives_its_kernels_to_the_compiled_region():
    torch._dynamo.reset()
    x = torch.randn(32, 32, device="neuron")
    run = torch.compile(lambda x: (x * 2 + 1).relu().sum(0), backend="neuron")
    run(x).cpu()  # recorded: the next call replays
    prof, stats = _profiled(lambda: run(x).cpu())
    assert stats["compiled"]["replays"] == 1 and not stats["compiled"]["replay_fallbacks"]
    averages = {e.key: e for e in prof.key_averages() if e.device_type == CPU}
    assert not any(key.startswith("aten::mul") for key in averages)  # no FX code ran
    (region,) = [e for key, e in averages.items() if key.startswith("Torch-Compiled Region")]
    assert _near(region.self_device_time_total, stats["device_time_us"]) and stats["device_time_us"] > 0
    torch._dynamo.reset()


def test_a_schedule_writes_one_trace_file_per_cycle_with_that_cycles_kernels(mode, tmp_path):
    step = _training_step(mode)
    launched = []

    def traced(prof):
        launched.append(adaptive_eager.stats()["kernels_launched"])
        tensorboard_trace_handler(str(tmp_path))(prof)

    with profile(activities=ACTIVITIES, schedule=schedule(wait=1, warmup=1, active=1, repeat=2),
                 on_trace_ready=traced) as prof:
        for _ in range(6):
            adaptive_eager.reset_stats()
            step()
            prof.step()
    files = sorted(glob.glob(os.path.join(tmp_path, "*.json")), key=os.path.getmtime)
    assert len(files) == 2 == len(launched)
    for path, count in zip(files, launched):
        events = json.load(open(path))["traceEvents"]
        assert sum(1 for e in events if e.get("cat") == "kernel") == count > 0
        assert any(e.get("cat") == "ac2g" for e in events)


def test_record_shapes_and_with_stack_keep_working_beside_the_device_events(tmp_path):
    adaptive_eager.disable()
    x = torch.randn(8, 8, device="neuron")
    prof, stats = _profiled(lambda: (x @ x).relu().cpu(), record_shapes=True, with_stack=True)
    assert len(_kernels(prof)) == stats["kernels_launched"] == 2
    mm = [e for e in prof.events() if e.name == "aten::mm" and e.device_type == CPU]
    assert mm and mm[0].input_shapes == [[8, 8], [8, 8]] and mm[0].self_device_time_total > 0
    assert any(e.is_python_function for e in prof.events())


def test_profile_memory_shows_device_allocations_and_frees(tmp_path):
    adaptive_eager.disable()
    x = torch.randn(256, device="neuron")
    torch.neuron.synchronize()

    def region():
        y = x.add(1)  # 1 KiB allocated inside aten::add
        torch.neuron.synchronize()
        del y  # freed here

    prof, _ = _profiled(region, profile_memory=True)
    add = next(e for e in prof.key_averages() if e.key == "aten::add" and e.device_type == CPU)
    assert add.self_device_memory_usage == 1024
    memory = [e for e in _trace(prof, tmp_path) if e.get("name") == "[memory]" and e["args"].get("Device Type") == 20]
    assert sorted(e["args"]["Bytes"] for e in memory) == [-1024, 1024]


def test_a_free_on_a_thread_the_profiler_does_not_cover_is_reported(tmp_path):
    adaptive_eager.disable()
    x = torch.randn(128, device="neuron")
    y = torch.randn(100, device="neuron").add(1)  # 400 bytes
    torch.neuron.synchronize()
    box = [y]
    del y

    def region():
        x.add(2).cpu()  # an op of the session (whose host thread's profiler state the free borrows)
        worker = threading.Thread(target=box.clear)  # the last reference dies on the user's thread
        worker.start()
        worker.join()

    prof, _ = _profiled(region, profile_memory=True)
    memory = [e for e in _trace(prof, tmp_path) if e.get("name") == "[memory]" and e["args"].get("Device Type") == 20]
    assert [e["args"]["Bytes"] for e in memory].count(-400) == 1


def test_a_cpu_only_profile_opens_no_device_session():
    x = torch.ones(4, device="neuron")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        recording = _C.profiler_recording()
        (x * 3).cpu()
    assert recording is False
    assert not [e for e in prof.events() if e.device_type == DEVICE]


def test_without_a_profiler_the_device_makes_no_profiler_call(monkeypatch, mode):
    """The per-op and per-launch cost with no profiler is one module-global read: the
    profiler's functions are never called (bench/overhead.py measures the host cost)."""
    calls = collections.Counter()
    for name in ("_op_issued", "_kernel_launched"):
        real = getattr(device_profiler, name)
        monkeypatch.setattr(device_profiler, name, lambda *a, _real=real, _name=name: (calls.update([_name]), _real(*a))[1])
    step = _training_step(mode)
    step()
    assert calls == {}
    prof, stats = _profiled(step)
    assert calls["_kernel_launched"] == stats["kernels_launched"] and calls["_op_issued"] == stats["ops_recorded"]


def test_profiling_does_not_change_how_a_window_is_queued():
    """The profiler lays kernels out at launch: a window stays one queue item (it was
    submitted kernel by kernel while profiling, for the worker's ranges)."""
    adaptive_eager.enable()
    x = torch.randn(32, device="neuron")

    def region():
        ((x * 2 + 1).relu() @ x.view(32, 1)).cpu()  # a matmul takes no prologue: two kernels

    with adaptive_eager.window_policy(on_chip_bytes=0):
        region()
        submitted, launched = QUEUE.submitted, adaptive_eager.stats()["kernels_launched"]
        region()
        unprofiled = QUEUE.submitted - submitted
        assert adaptive_eager.stats()["kernels_launched"] - launched == 2
        with profile(activities=ACTIVITIES):
            submitted = QUEUE.submitted
            region()
            profiled = QUEUE.submitted - submitted
    assert profiled == unprofiled
