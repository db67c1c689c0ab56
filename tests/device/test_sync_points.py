"""The sink and sync points (``device/hardware/sink.py``): where recorded ops go, and what
a sync point does (launch what the sink holds, wait for the device, raise the earliest
deferred error) against a drain (the same wait, raising nothing)."""
from __future__ import annotations

import pytest
import torch

import adaptive_eager
from adaptive_eager_device.hardware import sink


def test_the_strict_sink_launches_each_op_at_once(strict_mode):
    x = torch.randn(8).to("neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    y = (x * 2).relu()
    assert sink.current_sink().name == "strict"
    assert adaptive_eager.stats()["kernels_launched"] == 2  # no sync point needed
    del y


def test_changing_the_sink_flushes_the_previous_one_first(adaptive_mode):
    x = torch.randn(8)
    d = x.to("neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    y = (d * 2).relu()
    assert adaptive_eager.stats()["kernels_launched"] == 0  # in the window
    adaptive_eager.disable()  # the strict sink replaces the window: nothing recorded is lost
    assert adaptive_eager.stats()["flushes"]["by_reason"] == {"mode_change": 1}
    assert adaptive_eager.stats()["kernels_launched"] == 1
    torch.testing.assert_close(y.cpu(), (x * 2).relu())


def test_a_drain_waits_and_raises_nothing_a_sync_point_raises(any_mode):
    x = torch.randn(4).to("neuron")
    torch.neuron.synchronize()
    adaptive_eager.inject_fault("aten::mul", 1)
    y = x * 2
    sink.drain("test")  # every kernel ran, the failure stays pending
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="aten::mul"):
        sink.synchronize()
    sink.synchronize()  # raised once, then cleared: the device is usable again
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)
    del y


# -- the wait itself (ExecutionQueue.wait_for: executor.cpp's wait_completed) ------------------


def _worker_counts() -> dict:
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    return QUEUE.native_counts()


def test_a_sync_point_runs_no_python_on_the_worker(any_mode):
    """The host waits in C and the worker wakes it without the GIL: syncs and events put no
    Python item on the worker (a Fence item did, taking the GIL at every sync)."""
    x = torch.randn(64).to("neuron")
    torch.neuron.synchronize()
    before = _worker_counts()["python_items"]
    total = 0.0
    for i in range(20):
        total += (x + i).sum().item()
        event = torch.neuron.Event()
        event.record()
        event.synchronize()
        assert event.query()
    torch.neuron.synchronize()
    assert _worker_counts()["python_items"] == before
    cpu = x.cpu()
    assert total == sum((cpu + i).sum().item() for i in range(20))


def test_host_threads_waiting_at_once_each_wake_with_their_results(any_mode):
    """Several host threads wait for different points of the one queue at the same time:
    each returns only once its own work has run, with its own results."""
    import threading

    errors, results = [], {}

    def worker(index):
        try:
            x = torch.full((256,), float(index), device="neuron")
            got = []
            for step in range(100):
                got.append((x * step).sum().item())
            results[index] = got
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert {i: results[i] for i in range(4)} == {i: [256.0 * i * step for step in range(100)] for i in range(4)}


def _interrupted_sync(issue):
    """Issue work with ``issue()`` (one intra-op thread), then sync with a signal due in 20
    ms whose handler raises: returns how many items were still queued when the sync raised
    (it fails if the sync did not raise), once a later sync has run them."""
    import signal

    from adaptive_eager_device.hardware.execution_queue import QUEUE

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the work takes a second or so on any machine
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        issue()
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        with pytest.raises(Interrupted):
            torch.neuron.synchronize()
        return QUEUE.submitted - QUEUE.completed  # raised while waiting, not after
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        torch.neuron.synchronize()
        torch.set_num_threads(threads)


def test_a_signal_interrupts_a_host_waiting_for_the_worker(strict_mode):
    """A wait polls Python's signal handlers (Ctrl-C during a long sync raises, as a Python
    wait would), before the work it waits for has run; the queued work still runs and a
    later sync waits for it."""
    a = torch.randn(1024, 1024, device="neuron")
    torch.neuron.synchronize()
    result = []

    def issue():
        y = a
        for _ in range(40):  # 86 GFLOP on the worker: far more than the 100 ms between polls
            y = (y @ a).tanh()
        result.append(y)

    assert _interrupted_sync(issue) > 0
    expected = a.cpu()
    for _ in range(40):
        expected = (expected @ a.cpu()).tanh()
    torch.testing.assert_close(result[0].cpu(), expected)


def test_a_signal_interrupts_a_host_waiting_for_many_short_kernels(strict_mode):
    """The same when the worker finishes a few items every millisecond: the waiting host
    wakes every few items to release what ran (executor.cpp: wait_completed), never waits
    the 100 ms that would poll the handlers otherwise, and polls them at each wake-up."""
    x = torch.randn(1 << 18, device="neuron")  # 1 MiB
    torch.neuron.synchronize()
    result = []

    def issue():
        y = x
        for _ in range(8000):  # tens of microseconds each: far less than 100 ms per wake-up
            y = y * 1.0
        result.append(y)

    assert _interrupted_sync(issue) > 0
    assert torch.equal(result[0].cpu(), x.cpu())


def test_a_waiting_host_polls_only_while_a_core_is_left_free(any_mode, monkeypatch):
    """Polling before sleeping takes a core: the host waiting for the worker and the worker
    waiting for work poll only when the worker's intra-op threads (the host's
    ``torch.get_num_threads()``) leave one, re-decided by ``torch.set_num_threads``."""
    import os

    from adaptive_eager_device.hardware import execution_queue

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    torch.randn(4, device="neuron").sum().item()  # the worker runs
    saved = torch.get_num_threads()
    try:
        queue = execution_queue.QUEUE
        torch.set_num_threads(3)
        assert queue.spin_us == queue.native_counts()["idle_spin_us"] == execution_queue.SPIN_US > 0
        torch.set_num_threads(4)
        assert queue.spin_us == queue.native_counts()["idle_spin_us"] == 0
    finally:
        torch.set_num_threads(saved)
