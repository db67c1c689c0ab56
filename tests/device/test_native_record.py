"""The recorder's common case in C (``device/csrc/record.cpp``, ``_C.record``): a kernel
whose signature hits the shape cache is recorded in one C call, and everything it makes
(records, outputs, the queue's clocks and counters, errors) is what the Python recorder
(``device/ops/recorder.py``) makes for the same calls."""
from __future__ import annotations

import gc
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import keeping_records

from adaptive_eager_device import _C as _native
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.hardware.execution_queue import QUEUE
from adaptive_eager_device.memory.storage import DeviceStorage
from adaptive_eager_device.ops.cow import COW
from adaptive_eager_device.ops.dispatch import install_native_recorder


def program(x, w, ids):
    """Each kind of call the C recorder takes: Python numbers (a wrapped float, an int, a
    bool), two tensors, a view, a list of tensors, keyword arguments with a dtype, an
    in-place op returning its argument, an ``out=`` op, a tuple of results."""
    y = x * 1.5
    y = y + x
    y = torch.relu(y)
    m = y.t() @ w  # a view's reference (ViewRef)
    s = torch.cat([m, m], 0)
    s.add_(1.0)
    s.mul_(2)
    values, indices = s.max(dim=1)
    total = torch.sum(s, dim=(0,), keepdim=True, dtype=torch.float64)
    picked = torch.index_select(s, 0, ids)
    masked = torch.where(s > 0.5, s, torch.zeros_like(s))
    out = torch.empty_like(values)
    torch.mul(values, -0.0, out=out)
    flag = (s > 0) & True
    filled = torch.full((8, 3), 0.5, device=x.device)  # a factory's device=
    wide = s.to(torch.float64)  # _to_copy on the device
    out.copy_(values * 0.5)  # copy_ between neuron tensors
    q = torch.stack([s, s]).unsqueeze(0)
    attended = F.scaled_dot_product_attention(q, q, q)  # the CPU's flash kernel, dropout 0: tagged random
    batched = torch.matmul(torch.stack([s, s]), filled.t())  # its reshape: _unsafe_view, a C++ view
    tail = s[2:] * 2  # a view at an offset
    bits = s[2:].view(torch.int32) + 1  # another dtype over the bytes (a ReinterpretRef, not native)
    return [y, m, s, values, indices, total, picked, masked, out, flag, filled, wide, attended, batched, tail, bits]


# mul, add, relu, mm, cat, add_, mul_, max.dim, sum.dim_IntList, index_select, gt, where,
# mul.out, gt, bitwise_and, full, _to_copy, mul, copy_, stack, the flash attention kernel,
# stack, mm, mul, add
KERNEL_CALLS_TAKEN = 25


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 4), torch.randn(8, 3), torch.tensor([0, 3, 5])


@pytest.fixture(autouse=True)
def no_lazy_clone_yet(monkeypatch):
    """As in a process that made no lazy clone: an op writing a tensor is then taken too
    (after one, each write first checks for shared bytes, in Python: ``dispatch.run``).
    These tests' tensors are never lazily cloned."""
    monkeypatch.setattr(COW, "live", False)


@pytest.fixture
def without_native_recorder():
    """``record`` off for the test (every call takes the Python recorder), on again after."""
    _native.install_record(None)
    yield
    install_native_recorder()


def test_the_common_case_is_recorded_in_c_and_equals_the_cpu(strict_mode):
    x, w, ids = _inputs()
    on_device = [t.to("neuron") for t in (x, w, ids)]
    program(*on_device)  # every signature's first call: the Python recorder's (a cache miss)
    before = _native.record_counts()
    got = program(*on_device)
    recorded_in_c = _native.record_counts() - before
    for result, expected in zip(got, program(x, w, ids)):
        assert torch.equal(result.cpu(), expected)
    # every kernel call of the program is recorded in C but zeros_like's fill (the like-ops
    # take the Python route: empty_like, then a fill)
    assert recorded_in_c == KERNEL_CALLS_TAKEN


def test_it_answers_nothing_with_the_native_recorder_off(strict_mode, without_native_recorder):
    x = torch.ones(4, device="neuron")
    x * 2.5
    before = _native.record_counts()
    assert torch.equal((x * 2.5).cpu(), torch.full((4,), 2.5))
    assert _native.record_counts() == before


def _canonical(records):
    """The records with their storages numbered in order of first appearance, so two runs'
    records compare by structure."""
    numbers: dict = {}

    def plain(value):
        if type(value) is DeviceStorage:
            return ("storage", numbers.setdefault(id(value), len(numbers)))
        if type(value) in (list, tuple):
            return (type(value).__name__, tuple(plain(item) for item in value))
        if isinstance(value, torch.Tensor):  # a host snapshot
            return ("host", value.dtype, value.item())
        if hasattr(value, "storage") and hasattr(value, "offset"):  # a ViewRef, a ReinterpretRef
            return (type(value).__name__, plain(value.storage), value.shape, value.stride, value.offset,
                    getattr(value, "dtype", None))
        return value

    first = records[0].issue
    return [
        (r.op, plain(r.args), {k: plain(v) for k, v in r.kwargs.items()}, r.nested, plain(r.reads), plain(r.writes),
         plain(r.results), r.location, r.cost, r.signature, r.signature_id, r.stream, r.issue - first)
        for r in records
    ]


def _run_keeping(on_device):
    with keeping_records() as records:
        results = program(*on_device)
    return records, results


def test_its_records_are_the_python_recorders(strict_mode):
    on_device = [t.to("neuron") for t in _inputs()]
    program(*on_device)  # warm the shape cache
    before = _native.record_counts()
    from_c, _ = _run_keeping(on_device)
    assert _native.record_counts() - before == KERNEL_CALLS_TAKEN
    _native.install_record(None)
    try:
        from_python, _ = _run_keeping(on_device)
    finally:
        install_native_recorder()
    assert len(from_c) == len(from_python)
    for c, python in zip(_canonical(from_c), _canonical(from_python)):
        assert c == python


def _reset_clocks():
    torch.neuron.synchronize()
    QUEUE.clock_us = QUEUE.host_us = QUEUE.device_free_us = 0.0
    QUEUE._ends.clear()
    QUEUE.kernel_totals = {}
    COUNTERS.kernels_launched = COUNTERS.bytes_moved = COUNTERS.ops_recorded = 0
    COUNTERS.device_time_us = 0.0
    COUNTERS.launches_by_stream = {}


def _clocks():
    return (QUEUE.clock_us, QUEUE.host_us, QUEUE.device_free_us, list(QUEUE._ends),
            {key: list(totals) for key, totals in QUEUE.kernel_totals.items()}, COUNTERS.kernels_launched,
            COUNTERS.bytes_moved, COUNTERS.ops_recorded, COUNTERS.device_time_us, dict(COUNTERS.launches_by_stream))


def test_its_launches_keep_the_clocks_and_counters_of_the_python_path_to_the_bit(strict_mode):
    on_device = [t.to("neuron") for t in _inputs()]
    program(*on_device)
    _reset_clocks()
    before = _native.record_counts()
    results_c = program(*on_device)
    clocks_c = _clocks()
    assert _native.record_counts() - before == KERNEL_CALLS_TAKEN
    _native.install_record(None)
    try:
        _reset_clocks()
        results_python = program(*on_device)
        clocks_python = _clocks()
    finally:
        install_native_recorder()
    assert clocks_c == clocks_python
    for a, b in zip(results_c, results_python):
        assert torch.equal(a.cpu(), b.cpu())


def test_a_kernel_recorded_in_c_fails_at_the_next_sync_point_naming_the_users_line(strict_mode):
    x = torch.randn(4, 3, device="neuron")
    good = torch.tensor([0, 1], device="neuron")
    torch.index_select(x, 0, good)  # the signature's first call: cached
    bad = torch.tensor([0, 9], device="neuron")
    before = _native.record_counts()
    line = sys._getframe().f_lineno + 1
    torch.index_select(x, 0, bad)  # deferred: the index is data
    assert _native.record_counts() == before + 1
    with pytest.raises(Exception) as raised:
        torch.neuron.synchronize()
    assert f"{__file__}:{line}" in str(raised.value)
    assert "aten::index_select" in str(raised.value)


def test_what_it_does_not_take_goes_to_the_python_recorder(strict_mode):
    x = torch.ones(3, device="neuron")
    host = torch.ones(3)
    x + host[0]  # a 0-dim host tensor: taken (its snapshot)
    x + host[0]
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + host  # a host tensor of elements: CUDA's error, from the Python recorder
    before = _native.record_counts()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        x * 2.0  # observed: the profiler sees each op from the Python recorder
        x * 2.0
    assert _native.record_counts() == before


def test_its_records_are_left_to_reference_counting(strict_mode):
    """The record and its containers are not tracked by the garbage collector: they hold no
    reference cycle, and would otherwise reach the oldest generation before the worker is
    done with them, making every full collection walk them."""
    x = torch.ones(3, device="neuron")
    x * 2.0
    with keeping_records() as records:
        x * 2.0
    (record,) = records
    for container in (record, record.args, record.kwargs, record.reads, record.writes, record.results,
                      record.location):
        assert not gc.is_tracked(container)


def test_the_queues_bookkeeping_advances_the_simulated_clocks_as_documented(strict_mode, monkeypatch):
    """``ExecutionQueue._account`` (C: ``_C.account``, which both recorders reach): a launch
    starts when the device is free and the host has issued it, takes its time plus the launch
    overhead, and its end is kept until the simulated host has passed it."""
    from adaptive_eager_device.core.config import CONFIG

    monkeypatch.setattr(CONFIG, "launch_us", 10.0)
    _reset_clocks()
    assert QUEUE._account(1, 100, 5.0, None, 0, key="one") == 0.0
    assert (QUEUE.device_free_us, list(QUEUE._ends), QUEUE.clock_us) == (15.0, [15.0], 15.0)
    QUEUE.host_us = 20.0  # the host is past the first kernel's end: it is forgotten
    each = (("a", 10, 1.0, 1), ("b", 20, 2.0, 1))
    by_key = (("a", 1, 1.0, 10), ("b", 1, 2.0, 20))
    assert QUEUE._account(2, 30, 3.0, by_key, 0, each) == 20.0
    assert (QUEUE.device_free_us, list(QUEUE._ends), QUEUE.clock_us) == (43.0, [31.0, 43.0], 38.0)
    assert QUEUE.backlog_kernels() == 2
    QUEUE.host_us = 31.0
    assert QUEUE.backlog_kernels() == 1
    assert QUEUE.kernel_totals == {"one": [1, 15.0, 100], "a": [1, 11.0, 10], "b": [1, 12.0, 20]}
    assert (COUNTERS.kernels_launched, COUNTERS.bytes_moved, COUNTERS.device_time_us) == (3, 130, 38.0)
    assert COUNTERS.launches_by_stream == {0: 3}
    QUEUE._account(1, 1, 1.0, None, 0, key="one")  # totals add up per key
    assert QUEUE.kernel_totals["one"] == [2, 26.0, 101]


def test_calls_the_python_recorder_must_see_are_not_taken(strict_mode):
    """A random op that draws on the host, an upload, and a device index out of range take
    the Python route, which draws in program order, snapshots the host tensor, and raises
    ``check_ordinal``'s error."""
    q = torch.randn(1, 2, 4, 3, device="neuron")
    F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    before = _native.record_counts()
    torch.manual_seed(3)
    dropped = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).cpu()
    torch.manual_seed(3)
    assert torch.equal(dropped, F.scaled_dot_product_attention(q.cpu(), q.cpu(), q.cpu(), dropout_p=0.5))
    host = torch.ones(3)
    host.to("neuron")
    host.to("neuron")  # an upload: _to_copy of a host tensor
    assert _native.record_counts() == before
    torch.full((2,), 1.0, device="neuron")
    before = _native.record_counts()
    torch.full((2,), 1.0, device="neuron")  # cached: taken
    with pytest.raises(RuntimeError, match="neuron:5"):
        torch.full((2,), 1.0, device="neuron:5")
    assert _native.record_counts() == before + 1


def test_matmuls_reshape_is_a_view_made_in_cpp(monkeypatch):
    """``matmul`` of a batch by a matrix reshapes its result with ``_unsafe_view`` (a view
    autograd does not track): a C++ kernel (``views.cpp``), no Python view."""
    from adaptive_eager_device.ops import dispatch, views

    python_views = []
    monkeypatch.setattr(dispatch, "run_view", lambda entry, args, kwargs: python_views.append(entry.name)
                        or views.run_view(entry, args, kwargs))
    a, b = torch.randn(2, 5, 3), torch.randn(3, 4)
    got = torch.matmul(a.to("neuron"), b.to("neuron"))
    assert torch.equal(got.cpu(), torch.matmul(a, b))
    assert "aten::_unsafe_view" not in python_views


# -- the handler in C (device/csrc/hot_path.cpp: fast_kernel) ----------------------------


def test_a_kernel_reaches_the_recorder_without_the_python_handler(any_mode, monkeypatch):
    """The device's kernels do what ``backend._handle`` does in C when nothing is Python's
    to check; switched off, each call goes through the Python handler again."""
    from adaptive_eager_device import backend

    x = torch.randn(8, device="neuron")
    (x + x).cpu()
    calls = []
    original = backend._handle
    monkeypatch.setattr(backend, "_handle", lambda *args: calls.append(args[0]) or original(*args))
    y = torch.add(x, x)           # the boxed fallback's op
    z = torch.nn.functional.silu(x)  # a composite's own kernel (_dense_kernel)
    torch.testing.assert_close(y.cpu(), x.cpu() * 2, rtol=0, atol=0)
    torch.testing.assert_close(z.cpu(), torch.nn.functional.silu(x.cpu()), rtol=0, atol=0)
    assert calls == []
    _native.set_fast_path(None, None, None, None)
    try:
        (x + x).cpu()
        assert len(calls) >= 1
    finally:
        backend._make_handler()  # on again
    calls.clear()
    (x + x).cpu()
    assert calls == []


def test_the_c_handler_holds_the_host_lock_while_it_records(strict_mode, monkeypatch):
    from adaptive_eager_device import backend
    from adaptive_eager_device.hardware.execution_queue import HOST_LOCK

    held = []
    original = backend.run

    def run(entry, args, kwargs):  # the whole recorder, on a signature the C recorder has not met
        held.append(HOST_LOCK._is_owned())
        return original(entry, args, kwargs)

    monkeypatch.setattr(backend, "run", run)
    backend._make_handler()
    try:
        torch.full((3, 5, 7), 2.5, device="neuron").sum().item()
    finally:
        monkeypatch.undo()
        backend._make_handler()
    assert held and all(held)


def test_a_0_dim_host_tensor_is_snapshotted_when_the_op_is_recorded(strict_mode):
    """A 0-dim host tensor argument is copied when the C recorder records the op: the user
    may change it before the kernel runs (a Python number, which the dispatcher wraps in
    one, too). Both compute as the CPU does. (Taking every 0-dim host tensor as it is fails
    here.)"""
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    x = torch.arange(4.0, device="neuron")
    x + 1  # (the signatures' first calls: cached)
    x * torch.tensor(2.0)
    scale = torch.tensor(2.0)
    QUEUE.batch_items, items = 1 << 30, QUEUE.batch_items  # nothing reaches the worker before the sync
    try:
        before = _native.record_counts()
        scaled = x * scale
        scale.fill_(100.0)  # after the call, before the kernel runs
        shifted = x + 1
        assert _native.record_counts() == before + 2
    finally:
        QUEUE.batch_items = items
    torch.testing.assert_close(scaled.cpu(), torch.arange(4.0) * 2)
    torch.testing.assert_close(shifted.cpu(), torch.arange(4.0) + 1)
