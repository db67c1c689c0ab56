"""The execution queue (``device/hardware/execution_queue.py``): one FIFO, one worker, the
doorbell, and the launch accounting (counters and the simulated timeline), which a
window's launches in bulk and strict eager's one by one must keep identically."""
from __future__ import annotations

import threading

import pytest
import torch

from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.hardware.execution_queue import ExecutionQueue
from adaptive_eager_device.hardware.plan import LaunchCosts


class Item:
    """A queue item that records that it ran."""

    def __init__(self, ran: list, name: str) -> None:
        self.ran, self.name = ran, name
        self.done = threading.Event()

    def execute(self, queue) -> None:
        self.ran.append(self.name)
        self.done.set()


COSTS = [("aten::mul", 400, 12.5, 1), ("mul|add", 800, 20.0, 2), ("aten::mul", 400, 12.5, 1)]


def _counters() -> tuple:
    return COUNTERS.kernels_launched, COUNTERS.bytes_moved, COUNTERS.device_time_us


def _accounted(launch_all) -> tuple:
    """What launching ``COSTS`` on a fresh queue adds to the counters, and the queue's
    clocks and per-kernel totals afterwards."""
    queue = ExecutionQueue()
    queue.host_us = 3.0
    before = _counters()
    launch_all(queue)
    queue.drain()
    after = _counters()
    deltas = tuple(b - a for a, b in zip(before, after))
    return deltas, queue.clock_us, queue.device_free_us, {k: tuple(v) for k, v in queue.kernel_totals.items()}


def test_a_batch_is_accounted_as_its_launches_one_by_one():
    """``launch_batch`` (a window's command list) and ``launch`` per kernel share one
    accounting: counters, simulated clocks and per-kernel totals agree exactly."""
    ran: list = []

    def one_by_one(queue):
        for key, nbytes, time_us, ops in COSTS:
            queue.launch(Item(ran, key), key, nbytes, time_us, stream=0, ops=ops)

    def in_bulk(queue):
        queue.launch_batch([Item(ran, key) for key, *_ in COSTS], LaunchCosts(COSTS), stream=0)

    separate, bulk = _accounted(one_by_one), _accounted(in_bulk)
    assert separate == bulk
    deltas, clock, free, totals = bulk
    launch = CONFIG.launch_us  # added per launch at accounting (COSTS hold none)
    assert deltas == (3, 1600, 45.0 + 3 * launch) and clock == 45.0 + 3 * launch and free == 3.0 + 45.0 + 3 * launch
    assert totals == {"aten::mul": (2, 25.0 + 2 * launch, 800), "mul|add": (1, 20.0 + launch, 800)}
    assert ran == [key for key, *_ in COSTS] * 2  # in order, both times


def test_items_wait_for_the_doorbell():
    """Submitted items reach the worker only when the host rings: a full batch or a sync
    point (ringing per item would trade the GIL between the two threads on every op)."""
    queue = ExecutionQueue()
    queue.batch_items = 3
    ran: list = []
    first, second, third = (Item(ran, name) for name in ("a", "b", "c"))
    queue.submit(first)
    queue.submit(second)
    assert not first.done.wait(0.2) and ran == []  # a batch of two: not rung
    queue.submit(third)  # the third fills the batch: rung
    assert third.done.wait(10) and ran == ["a", "b", "c"]
    fourth = Item(ran, "d")
    queue.submit(fourth)
    queue.drain()  # a sync point rings, and waits
    assert ran == ["a", "b", "c", "d"] and queue.completed == queue.submitted  # (the fence counts too)


def test_the_backlog_is_the_simulated_device_ahead_of_the_host():
    queue = ExecutionQueue()
    queue.launch(Item([], "k"), "k", 0, 90.0, stream=0)
    assert queue.backlog_us() == 90.0 + CONFIG.launch_us == 100.0  # the kernel and its launch
    queue.issue_ops(4)  # four ops issued at CONFIG.host_us_per_op (5 us) each
    assert queue.backlog_us() == pytest.approx(80.0)
    queue.wait()  # the simulated host waited for the device
    assert queue.backlog_us() == 0.0


def test_a_failure_is_kept_until_the_wait_then_cleared(strict_mode):
    x = torch.randn(4).to("neuron")
    torch.neuron.synchronize()
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    QUEUE.inject_fault("aten::mul", 1)
    y = x * 2
    QUEUE.drain()  # waits, raises nothing: the failure stays pending
    assert QUEUE.failures.first is not None
    with pytest.raises(RuntimeError, match="aten::mul"):
        QUEUE.wait()
    assert QUEUE.failures.first is None
    del y
