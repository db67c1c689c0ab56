"""The device worker runs kernels in C++ (``device/csrc/executor.cpp``): a strict op, an
adaptive window (its fused kernels, their registers, their library kernels) as one
native launch each, with no Python; anything unusual goes back to the Python path, which
applies the failure rules and names the op. ``NEURON_NATIVE=0`` (``CONFIG.native``) runs
everything through Python: the reference the native path must equal."""
from __future__ import annotations

import sys
import threading
import weakref
import time

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware.execution_queue import QUEUE


def counts() -> dict:
    QUEUE.drain()
    return QUEUE.native_counts()


def delta(before: dict) -> dict:
    after = counts()
    return {key: after[key] - before[key] for key in ("native_launches", "fallbacks")}


def program(x, w, index):
    """A little of everything: a matmul with a transposed view, pointwise chains, a
    reduction, a gather, an in-place update, a Python scalar for a tensor argument."""
    h = F.gelu(x @ w.t()) * 0.5 + x[:, :8].sum()
    h = h.softmax(-1)
    picked = h.index_select(0, index)
    h.add_(1.0)
    return h, picked, h.mean(-1)


@pytest.fixture(params=[True, False], ids=["native", "python"])
def native(request):
    saved = CONFIG.native
    CONFIG.native = request.param
    yield request.param
    CONFIG.native = saved


def test_native_and_python_paths_give_the_cpu_numbers_bit_for_bit(any_mode, native):
    torch.manual_seed(0)
    x, w, index = torch.randn(6, 16), torch.randn(16, 16), torch.tensor([4, 0, 4])
    on = [t.to("neuron") for t in (x, w, index)]
    before = counts()
    got = program(*on)
    expected = program(x, w, index)
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b)
    ran = delta(before)
    assert ran["fallbacks"] == 0
    assert (ran["native_launches"] > 0) == native


def test_an_op_that_raises_inside_a_native_launch_is_named_with_its_line(any_mode):
    """The native run stops at the op that raises and hands the rest to Python, which
    runs it again under the failure rules: the error names that op and the user's line."""
    x = torch.randn(5, 4).to("neuron")
    bad = torch.tensor([1, 7]).to("neuron")  # 7 is out of range: only the data says so
    torch.neuron.synchronize()
    before = counts()
    y = (x * 2).relu()
    line = sys._getframe().f_lineno + 1
    picked = y.index_select(0, bad)
    after = picked + 1
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as info:
        after.cpu()
    assert info.value.op_name == "aten::index_select"
    assert f"test_native_execution.py:{line}" in str(info.value)
    assert delta(before)["fallbacks"] >= 1
    # the device is usable again, natively
    before = counts()
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)
    assert delta(before) == {"native_launches": 1, "fallbacks": 0}


def test_launches_issued_while_a_failure_is_pending_are_dropped_by_the_python_path(strict_mode):
    x = torch.randn(4).to("neuron")
    torch.neuron.synchronize()
    adaptive_eager.inject_fault("aten::mul", 1)
    y = x * 2
    QUEUE.drain()  # it failed on the worker; the failure is pending
    adaptive_eager.clear_faults()
    before = counts()
    z = x + 1  # issued after the failure: handed to Python, dropped, its output poisoned
    QUEUE.drain()
    assert delta(before) == {"native_launches": 0, "fallbacks": 1}
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="aten::mul"):
        y.cpu()
    with pytest.raises(adaptive_eager.PoisonedTensorError):
        z.cpu()


def test_an_index_driven_write_that_raises_keeps_its_target(strict_mode):
    """``index_put_`` checks its indices while it writes: a native run that raises part
    way restores the target before Python runs it again (GUARDED_WRITES), so the target
    keeps its last good values, as the failure rules promise."""
    target = torch.zeros(4, 3)
    on_target = target.to("neuron")
    index = torch.tensor([0, 9]).to("neuron")
    values = torch.ones(2, 3).to("neuron")
    torch.neuron.synchronize()
    on_target.index_put_((index,), values)
    with pytest.raises(adaptive_eager.NeuronRuntimeError):
        torch.neuron.synchronize()
    assert torch.equal(on_target.cpu(), target)


def test_native_launches_run_while_the_host_holds_the_gil():
    """The worker takes no GIL for a native launch: while the host thread runs pure Python
    (holding the GIL, with a long switch interval) the queued kernels still complete.
    Python items would wait the switch interval for every one of them."""
    adaptive_eager.disable()
    x = torch.randn(32, 32).to("neuron")
    torch.neuron.synchronize()
    saved = (QUEUE.batch_items, sys.getswitchinterval())
    QUEUE.batch_items = 10**6  # nothing reaches the worker until the ring below
    try:
        ys = [x * float(i) for i in range(200)]
        issued = QUEUE.submitted
        sys.setswitchinterval(0.5)
        QUEUE.ring()
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:  # pure Python: the GIL stays with this thread
            pass
        done = QUEUE.completed
    finally:
        sys.setswitchinterval(saved[1])
        QUEUE.batch_items = saved[0]
    assert done >= issued, (done, issued)
    del ys


def softmax_by_hand(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def test_a_window_is_one_native_launch_with_its_registers_and_library_kernels(adaptive_mode):
    """Dead intermediates stay in the run's environment; a softmax chain written by hand
    runs as its library kernel; the results are the CPU's."""
    x = torch.randn(8, 32)
    d = x.to("neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    before = counts()
    with adaptive_eager.window_policy(min_ops=10**6, max_ops=10**6):
        out = (softmax_by_hand(d @ d.t()) * 3).sum(-1)
        torch.testing.assert_close(out.cpu(), (softmax_by_hand(x @ x.t()) * 3).sum(-1))
    ran = delta(before)
    assert ran == {"native_launches": 1, "fallbacks": 0}
    assert adaptive_eager.stats()["patterns"]["softmax"]["matched"] == 1


def test_the_worker_never_drops_a_python_object():
    """Native launches hold Python objects (their records, the storages); the host
    releases them, with the GIL, once they ran (``Worker.release``), never the worker
    thread: an intermediate whose last reference is a launch's is freed on the host."""
    from adaptive_eager_device.memory.tensor import storage_of

    adaptive_eager.disable()
    freed_on = []
    watched = []  # a weak reference's callback runs on the thread that frees its storage

    def watch(tensor):
        watched.append(weakref.ref(storage_of(tensor), lambda _: freed_on.append(threading.current_thread())))

    x = torch.randn(64).to("neuron")
    before = counts()
    for _ in range(20):
        y = x * 2
        x = y + 1  # the previous x and y: referenced by the launches alone once replaced
        watch(y)
        watch(x)
    del y
    torch.neuron.synchronize()
    assert delta(before)["native_launches"] == 40
    assert freed_on and set(freed_on) == {threading.main_thread()}
