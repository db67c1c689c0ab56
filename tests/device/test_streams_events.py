"""Streams and events on the single hardware queue."""
import torch

import adaptive_eager
from conftest import assert_same


def test_streams_share_one_queue_and_keep_issue_order(any_mode):
    a, b = torch.neuron.Stream(), torch.neuron.Stream()
    x = torch.randn(256, 256)
    with torch.neuron.stream(a):
        produced = (x.to("neuron") @ x.to("neuron")).relu()  # producer on stream A
    with torch.neuron.stream(b):
        consumed = produced * 2 + 1  # consumer on stream B, no wait_stream
    assert_same(consumed, (x @ x).relu() * 2 + 1)


def test_launches_are_counted_per_stream(strict_mode):
    s = torch.neuron.Stream()
    x = torch.ones(4, device="neuron")  # default stream: 1 launch (fill_)
    with torch.neuron.stream(s):
        y = x + 1  # stream s: 2 launches
        y.mul_(3)
    torch.neuron.synchronize()
    assert adaptive_eager.stats()["launches_by_stream"] == {"0": 1, str(s.stream_id): 2}


def test_current_default_and_set_stream():
    default = torch.neuron.default_stream()
    assert torch.neuron.current_stream() == default and default.stream_id == 0
    s = torch.neuron.Stream()
    torch.neuron.set_stream(s)
    try:
        assert torch.neuron.current_stream() == s
    finally:
        torch.neuron.set_stream(default)
    assert torch.neuron.current_stream() == default
    assert isinstance(s, torch.Stream) and s.device == torch.device("neuron", 0)
    # PyTorch's Python device guard holds no streams: torch.accelerator sees the default
    assert torch.accelerator.current_stream().device == torch.device("neuron", 0)


def test_torch_compile_still_works_beside_the_device():
    compiled = torch.compile(lambda x: torch.relu(x) * 2)
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), torch.relu(x) * 2)


def test_stream_query_synchronize_wait_stream_record_stream(any_mode):
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        y = torch.randn(64, 64, device="neuron") @ torch.randn(64, 64, device="neuron")
    s.wait_stream(torch.neuron.current_stream())
    torch.neuron.current_stream().wait_stream(s)
    y.record_stream(s)
    s.synchronize()
    assert s.query()
    assert torch.neuron.current_stream().query()


def test_event_elapsed_time_is_simulated_device_time(any_mode):
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    a = torch.ones(1024, 1024, dtype=torch.bfloat16, device="neuron")
    start.record()
    b = a @ a  # compute-bound: 8 x 8 x 2 nc_matmul tiles of 512 cycles at 2.4 GHz on two cores, plus 10 us launch
    end.record()
    end.synchronize()
    assert start.query() and end.query()
    expected_us = 10.0 + 8 * 8 * 2 * 512 / 2 / 2.4e9 * 1e6
    assert abs(start.elapsed_time(end) - expected_us / 1000) < 1e-9
    assert b.dtype == torch.bfloat16


def test_event_wait_and_stream_record_event():
    s = torch.neuron.Stream()
    e = s.record_event()
    e.wait(torch.neuron.current_stream())
    torch.neuron.current_stream().wait_event(e)
    e.synchronize()
    assert e.query()


def test_elapsed_time_requires_timing_events():
    import pytest

    a, b = torch.neuron.Event(), torch.neuron.Event()
    a.record()
    b.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        a.elapsed_time(b)


def test_after_a_synchronize_the_stream_is_done_at_once(any_mode):
    """A fence signals the host before the worker counts it finished: query() right after
    a sync point must not see the fence as pending (a race; provoked by repetition)."""
    x = torch.ones(4, device="neuron")
    stream = torch.neuron.current_stream()
    for _ in range(2000):
        x = x + 1
        torch.neuron.synchronize()
        assert stream.query()
