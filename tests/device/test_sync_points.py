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
