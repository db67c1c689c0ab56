"""Compiled graphs replay their recorded launches (adaptive_eager/replay.py): a later call
with the same input signature runs no FX code and no per-op dispatch, and gives the same
results, launches, bytes and device time as running the FX code, with results equal to
CPU eager; calls the template cannot stand for run the FX code, and say why."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager_device import _C as _native
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.core.counters import COUNTERS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.workloads import GPT, Llama  # noqa: E402

HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    saved = CONFIG.compiled_replay
    yield
    CONFIG.compiled_replay = saved
    torch._dynamo.reset()


def compiled():
    return adaptive_eager.stats()["compiled"]


DISPATCHED = [0]  # ops through the per-op path (recorder.record_kernel), counted by the fixture


@pytest.fixture(autouse=True)
def count_dispatch(monkeypatch):
    from adaptive_eager_device.ops import recorder

    record_call = recorder._record_call  # once per op recorder.record_kernel records

    def counted(*args):
        DISPATCHED[0] += 1
        return record_call(*args)

    monkeypatch.setattr(recorder, "_record_call", counted)


def _figures():
    recorded_in_c = _native.record_counts()  # the per-op path's common case (device/csrc/record.cpp)
    return (DISPATCHED[0] + recorded_in_c, COUNTERS.kernels_launched, COUNTERS.bytes_moved, COUNTERS.device_time_us)


def _delta(before):
    """(ops dispatched one by one, launches, bytes, device time) since ``before``; device time is a
    running float sum, so its deltas are rounded to well below a nanosecond."""
    ops, launches, nbytes, time_us = (b - a for a, b in zip(before, _figures()))
    return ops, launches, nbytes, round(time_us, 6)


def test_a_second_call_replays_no_op_is_recorded_and_its_figures_equal_the_recorded_calls():
    def f(x, w):
        return torch.softmax(x @ w, -1).sum(0) * 2

    g = torch.compile(f)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    dx, dw = x.to("neuron"), w.to("neuron")
    before = _figures()
    first = g(dx, dw)
    recorded = _delta(before)
    torch.neuron.synchronize()
    for _ in range(3):
        before = _figures()
        again = g(dx, dw)
        replayed = _delta(before)
        assert replayed[0] == 0 and recorded[0] > 0  # no op went through the per-op path
        assert replayed[1:] == recorded[1:]  # launches, bytes, device time as recorded
        assert torch.equal(again.cpu(), first.cpu())
    torch.testing.assert_close(first.cpu(), f(x, w))
    stats = compiled()
    assert stats["replays"] == 3 and stats["replay_fallbacks"] == {}


def _train(model, device, steps, replay=True):
    CONFIG.compiled_replay = replay
    torch.manual_seed(0)
    model = model.to(device)
    # eps as in test_compile.py: attention's key bias has gradients that are rounding noise
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(device).reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    run = torch.compile(step) if device == "neuron" else step
    losses, figures = [], []
    for _ in range(steps):
        before = _figures()
        losses.append(run().cpu())
        figures.append(_delta(before))
    torch._dynamo.reset()
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()], figures


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_replayed_training_steps_equal_cpu_and_the_fx_code_bit_for_bit(name):
    torch.manual_seed(0)
    build = {"gpt": lambda: GPT(vocab=64, dim=32, heads=2, layers=1, seq=16),
             "llama": lambda: Llama(vocab=64, dim=32, heads=2, hidden=48, layers=1)}[name]
    model = build()
    adaptive_eager.reset_stats()
    losses, params, figures = _train(copy.deepcopy(model), "neuron", 4)
    stats = compiled()
    graphs = [g for g in stats["graphs"].values() if g["calls"]]
    assert all(g["replays"] == g["calls"] - 1 == 3 for g in graphs)  # each graph: steps 2-4 replay
    kinds = {g["kind"] for g in stats["graphs"].values() if g["replays"]}
    assert {"forward", "backward", "inference"} <= kinds
    # AdamW's step counters are CPU tensors: its graph's host part is split off and rerun
    (optimizer,) = [g for g in graphs if g["host_values_split_off"]]
    assert optimizer["replays"] == 3
    assert stats["replay_fallbacks"] == {}  # every call after the first of each graph replays
    fx_losses, fx_params, fx_figures = _train(copy.deepcopy(model), "neuron", 4, replay=False)
    cpu_losses, cpu_params, _ = _train(copy.deepcopy(model), "cpu", 4)
    assert torch.equal(losses, fx_losses)
    for got, fx, want in zip(params, fx_params, cpu_params):
        assert torch.equal(got, fx)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)
    for replayed, ran in zip(figures[1:], fx_figures[1:]):
        assert replayed[1:] == ran[1:]  # launches, bytes, device time
        assert replayed[0] < ran[0]  # fewer ops through the per-op path


def test_a_replays_plan_cache_key_is_the_one_its_records_make(monkeypatch):
    """A replay hands its window's flush the key its template precomputed
    (``Template.structure``); it must be ``_structure`` of the records it issued: storages
    numbered alike, and the same escape bits (outputs escape, intermediates do not, a
    written input's by whether it is still referenced). The Python path issues the records
    (a native replay looks the plan up by the same key and never makes them)."""
    from adaptive_eager.window import AdaptiveSink
    from adaptive_eager_device.core.config import CONFIG

    monkeypatch.setattr(CONFIG, "native", False)
    flush = AdaptiveSink.flush
    keys = []

    def checked(self, reason, key=None):
        if key is not None:
            keys.append(key)
            assert key == AdaptiveSink._structure(self.records)
        return flush(self, reason, key)

    monkeypatch.setattr(AdaptiveSink, "flush", checked)
    torch.manual_seed(0)
    adaptive_eager.reset_stats()
    _train(Llama(vocab=64, dim=32, heads=2, hidden=48, layers=1), "neuron", 3)
    stats = compiled()
    assert len(keys) == stats["replays"] >= 6  # forward, backward, optimizer...: steps 2 and 3 replay


def test_a_replays_key_marks_a_written_input_nothing_references_any_more(monkeypatch):
    """The one escape bit a template cannot know in advance: whether an input it writes
    in place is still referenced at the flush (if not, the write need not be written
    back). ``Template.structure`` reads it from the call's storage, as ``_structure``."""
    from adaptive_eager import compiler, replay
    from adaptive_eager.window import AdaptiveSink

    runners = []
    init = compiler.GraphRunner.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(compiler.GraphRunner, "__init__", kept)

    def f(x, y):
        x.mul_(2)
        return x + y

    g = torch.compile(f)
    x, y = torch.randn(8, device="neuron"), torch.randn(8, device="neuron")
    g(x, y)
    (runner,) = runners
    (template,) = [t for t in runner.templates.values() if type(t) is replay.Template]
    args = [x, y]
    _, storages = replay.input_signature(args)
    table, cells, _ = template.binder.call(args, storages, CONFIG.hbm_bytes)
    cells.wrap(table)  # the records name every storage
    records = template.issue(table)  # (never launched)
    alive = template.structure(table)
    assert alive == AdaptiveSink._structure(records)
    written = storages[0]
    written.alive = False  # as if nothing referenced x any more
    try:
        dead = template.structure(table)
        assert dead == AdaptiveSink._structure(records) and dead != alive
    finally:
        written.alive = True


def test_host_tensor_inputs_are_snapshotted_again_at_each_replay():
    g = torch.compile(lambda x: x.to("neuron") * 2)
    for value in (1.0, 2.0, 3.0):
        x = torch.full((4,), value)
        assert g(x).cpu().tolist() == [2 * value] * 4
    assert compiled()["replays"] == 2


def _mutating_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        doubled = a * 2
        read = b + 1
        torch.ops.aten.copy_.default(a, doubled)
        return (read,)

    return make_fx(f, tracing_mode="fake")(torch.randn(4), torch.randn(4))


def test_a_call_whose_mutated_inputs_alias_falls_back_and_says_why():
    from adaptive_eager.compiler import GraphRunner

    runner = GraphRunner(_mutating_graph(), "inference")
    for _ in range(2):
        a = torch.arange(4.0, device="neuron")
        (read,) = runner([a, torch.ones(4, device="neuron")])
        assert a.cpu().tolist() == [0, 2, 4, 6] and read.cpu().tolist() == [2, 2, 2, 2]
    assert runner.entry["replays"] == 1
    for _ in range(2):
        a = torch.arange(4.0, device="neuron")
        (read,) = runner([a, a.view(4)])  # b is a: the graph as traced runs
        assert a.cpu().tolist() == [0, 2, 4, 6] and read.cpu().tolist() == [1, 2, 3, 4]
    assert runner.entry["replays"] == 1
    assert runner.entry["replay_fallbacks"] == {"mutated inputs alias: the graph as traced runs": 1}


def _line_of(text: str) -> int:
    with open(HERE) as handle:
        return next(i for i, line in enumerate(handle, 1) if text in line)


def test_a_failing_kernel_in_a_replayed_graph_raises_at_the_next_sync_naming_the_users_line():
    def f(x, index):
        y = x.exp()
        z = torch.gather(y, 0, index)  # fails when an index is out of range
        return z * 3

    g = torch.compile(f)
    x = torch.randn(4)
    good, bad = torch.tensor([0, 3]), torch.tensor([0, 9])
    torch.testing.assert_close(g(x.to("neuron"), good.to("neuron")).cpu(), f(x, good))
    result = g(x.to("neuron"), bad.to("neuron"))  # same signature: replayed
    assert compiled()["replays"] == 1
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as raised:
        result.cpu()
    message = str(raised.value)
    assert f"{HERE}:{_line_of('z = torch.gather(y, 0, index)  # fails')} in f" in message
    assert "aten::gather" in message
    with pytest.raises(adaptive_eager.PoisonedTensorError):
        result.cpu()
    torch.testing.assert_close(g(x.to("neuron"), good.to("neuron")).cpu(), f(x, good))  # recovers


def test_a_replayed_launch_handed_back_to_python_runs_its_intermediates_ops():
    """A replayed call's intermediates are cells without storages (``Template.bind``);
    when the worker hands its launch to the Python fallback (here: an input poisoned by an
    earlier failure), the fallback's records need their storages, made over the same
    cells: the ops that do not read the poisoned input compute as eager does."""
    def f(x, y):
        a = x.exp()
        b = a * 2 + 1  # intermediates, read by the fallback's records
        return b.sin(), y + 1

    g = torch.compile(f)
    x, y = torch.randn(64), torch.randn(64)
    torch.testing.assert_close([t.cpu() for t in g(x.to("neuron"), y.to("neuron"))], list(f(x, y)))
    index = torch.full((64,), 9, device="neuron")
    poisoned = torch.gather(torch.randn(64, device="neuron"), 0, index.clamp(max=8) * 9)  # fails on the device
    with pytest.raises(adaptive_eager.NeuronRuntimeError):
        torch.neuron.synchronize()
    fallbacks = _native_fallbacks()
    first, second = g(x.to("neuron"), poisoned)  # replayed; its launch runs in Python
    assert compiled()["replays"] == 1
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as raised:
        torch.neuron.synchronize()  # the op that read the poisoned input
    assert f"{HERE}:{_line_of('return b.sin(), y + 1')} in f" in str(raised.value)
    torch.testing.assert_close(first.cpu(), f(x, y)[0])
    with pytest.raises(adaptive_eager.PoisonedTensorError):
        second.cpu()
    assert _native_fallbacks() > fallbacks  # the launch went to the Python fallback


def _native_fallbacks():
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    return QUEUE.native_counts().get("fallbacks", 0)


def test_launch_blocking_runs_the_fx_code_and_raises_inside_the_call():
    def f(x):
        return (x.exp() * 3).sum()

    g = torch.compile(f)
    assert g(torch.ones(3, device="neuron")).item() == pytest.approx(f(torch.ones(3)).item())
    CONFIG.launch_blocking = True
    adaptive_eager.inject_fault("aten::mul")
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="aten::mul"):
        g(torch.ones(3, device="neuron"))
    assert compiled()["replay_fallbacks"] == {"NEURON_LAUNCH_BLOCKING": 1}


def test_random_ops_and_sync_points_run_the_fx_code():
    def f(x):
        return F.dropout(x, 0.5, training=True) * 2

    g = torch.compile(f)
    torch.manual_seed(3)
    got = [g(torch.ones(64, device="neuron")).cpu() for _ in range(3)]
    torch.manual_seed(3)
    want = [f(torch.ones(64)) for _ in range(3)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert compiled()["replay_fallbacks"] == {"the graph draws random numbers": 2}
    assert compiled()["replays"] == 0


def _simulated_kernels(events):
    from adaptive_eager_device.hardware.trace import SIMULATED_PID

    return [(e["name"], round(e["dur"], 6)) for e in events if e.get("pid") == SIMULATED_PID and e["ph"] == "X"]


def test_a_traced_replay_shows_the_recorded_calls_kernels_on_the_timeline():
    from adaptive_eager_device.hardware import trace

    def f(x, w):
        return torch.relu(x @ w).sum(0) * 2

    g = torch.compile(f)
    x, w = torch.randn(8, 16, device="neuron"), torch.randn(16, 16, device="neuron")
    trace.start()
    g(x, w).cpu()  # recorded: the FX code runs
    recorded = _simulated_kernels(trace.stop()["traceEvents"])
    trace.start()
    again = g(x, w).cpu()  # replayed
    replayed = _simulated_kernels(trace.stop()["traceEvents"])
    assert compiled()["replays"] == 1
    assert recorded and replayed == recorded  # the same kernels, names and simulated durations
    torch.testing.assert_close(again, f(x.cpu(), w.cpu()))


def test_under_the_profiler_calls_replay_and_the_profiler_sees_their_kernels():
    """A call replays under torch.profiler as it does unprofiled; its kernels are device
    events with the compiled region's device time (tests/device/test_profiler.py)."""
    from torch.profiler import ProfilerActivity

    def f(x):
        return (x.exp() * 3).sum(0)

    g = torch.compile(f)
    x = torch.randn(4, 8, device="neuron")
    g(x)
    launches = compiled()["launches"]
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as profile:
        got = g(x).cpu()
    assert compiled()["replays"] == 1 and compiled()["replay_fallbacks"] == {}
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1
               and not e.is_user_annotation]
    assert len(kernels) == compiled()["launches"] - launches > 0
    torch.testing.assert_close(got, f(x.cpu()))


def test_a_replay_that_cannot_allocate_runs_the_fx_code_which_raises_at_the_op_and_loses_nothing():
    def f(x):
        big = x.repeat(64, 1)  # 64x the input's memory
        return big.sum(0)

    g = torch.compile(f)
    x = torch.randn(256, 256)
    dx = x.to("neuron")
    torch.testing.assert_close(g(dx).cpu(), f(x))  # recorded
    saved = CONFIG.hbm_bytes
    CONFIG.hbm_bytes = torch.neuron.memory_allocated() + 4 * (1 << 20)  # room for 4 MiB more: not 16
    try:
        with pytest.raises(torch.OutOfMemoryError, match="out of device memory"):
            g(dx)
    finally:
        CONFIG.hbm_bytes = saved
    assert compiled()["replay_fallbacks"] == {"out of memory: the FX code raises at the op": 1}
    assert torch.equal(dx.cpu(), x)  # nothing on the device was lost
    torch.testing.assert_close(g(dx).cpu(), f(x))  # and the next call replays
    assert compiled()["replays"] == 1


def _books():
    from adaptive_eager_device.memory.storage import MEMORY

    return MEMORY.allocations, MEMORY.live_blocks, torch.neuron.memory_allocated()


def test_a_replay_books_the_memory_the_recorded_call_booked():
    """A replay books all of a call's storages at once (``DeviceStorage.allocate_all``):
    as many allocations, live blocks, bytes and peak as the recorded call's one by one."""
    def f(x, w):
        h = torch.relu(x @ w)
        return (h * 3).sum(1), h.t() + 1

    g = torch.compile(f)
    x, w = torch.randn(64, 48), torch.randn(48, 80)
    dx, dw = x.to("neuron"), w.to("neuron")
    figures = []
    for _ in range(3):
        torch.neuron.synchronize()
        torch.neuron.reset_peak_memory_stats()
        before = _books()
        outputs = g(dx, dw)
        during = _books()
        peak = torch.neuron.max_memory_allocated()
        torch.neuron.synchronize()
        after = _books()
        figures.append(([b - a for a, b in zip(before, during)], peak - before[2],
                        [b - a for a, b in zip(before, after)][1:]))
        for got, want in zip(outputs, f(x, w)):
            torch.testing.assert_close(got.cpu(), want)
        del outputs
    assert compiled()["replays"] == 2
    assert figures[1] == figures[0] and figures[2] == figures[0]
    assert figures[0][0][0] > 2 and figures[0][1] > 0


def _resizing_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a):
        torch.ops.aten.t_.default(a)
        return (a * 2,)

    return make_fx(f, tracing_mode="fake")(torch.randn(2, 3))


def test_a_call_that_changes_an_inputs_metadata_is_never_replayed():
    from adaptive_eager.compiler import GraphRunner

    runner = GraphRunner(_resizing_graph(), "inference")
    for _ in range(3):
        a = torch.arange(6.0).view(2, 3)
        d = a.to("neuron")
        (out,) = runner([d])
        assert d.shape == (3, 2) and torch.equal(out.cpu(), a.t() * 2)
    assert runner.entry["replays"] == 0
    assert runner.entry["replay_fallbacks"] == {"the call changed an input's metadata": 2}


def test_the_c_input_signature_is_the_python_one():
    """A compiled call's input signature is made in C when every input is a neuron tensor
    or a number (``_C.input_signature``); templates recorded either way must match, so the
    key and storages equal the Python version's (given a tuple, which it answers) for
    tensors covering their storage, views, shared storages, conjugate and negative bits,
    parameters and numbers of every scalar type."""
    from adaptive_eager import replay

    base = torch.randn(4, 6, device="neuron")
    z = torch.randn(3, dtype=torch.complex64, device="neuron")
    parameter = torch.nn.Parameter(torch.randn(5, device="neuron"))
    storage_only = torch.empty(0, device="neuron").set_(torch.UntypedStorage(64, device="neuron"), 0, (4,), (1,))
    cases = [
        [base, base[1:], base.t(), base, 2, 0.5, True, None],
        [z.conj(), z, z._neg_view(), parameter, storage_only],
        [base[:, ::2], base.view(6, 4), 3.0, False],
        [],
    ]
    for args in cases:
        in_c = replay.input_signature(list(args))
        in_python = replay.input_signature(tuple(args))
        assert in_c[0] == in_python[0]
        assert len(in_c[1]) == len(in_python[1]) and all(a is b for a, b in zip(in_c[1], in_python[1]))
    host = [base, torch.randn(3)]  # a host tensor: the Python version answers
    assert replay.input_signature(host)[0] == replay.input_signature(tuple(host))[0]
    assert replay.input_signature([base, object()]) == ("an input a template cannot bind", None)


def test_a_replays_outputs_are_made_as_the_recorded_calls_were():
    """The C binder (``_C.ReplayBinder``) makes a replay's outputs as the recorded call made
    them: an input returned is that input, an output returned twice is one tensor, a view
    of an output shares its storage with the layout recorded, and every value is the CPU's."""
    def f(x):
        y = x * 2
        z = (y + 1).t()
        return x, y, y, y[1:, 2:], z, z.sum()

    g = torch.compile(f)
    x = torch.randn(4, 6)
    dx = x.to("neuron")
    for call in range(3):
        out = g(dx)
        assert out[0] is dx and out[1] is out[2]
        assert out[3].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
        assert (out[3].shape, out[3].stride(), out[3].storage_offset()) == ((3, 4), (6, 1), 8)
        assert (out[4].shape, out[4].stride()) == ((6, 4), (1, 6))
        for got, want in zip(out, f(x)):
            assert got.device.type == "neuron"
            torch.testing.assert_close(got.cpu(), want)
    assert compiled()["replays"] == 2


def test_a_replay_finds_its_plan_again_without_its_key_while_the_plan_cache_is_unchanged(monkeypatch):
    """``Template.plan_for`` builds and hashes a replay's plan-cache key only when the cache
    changed since the last plan it found (or a written input's ``alive`` bit did); each
    replay still counts one plan-cache hit, as a lookup does."""
    from adaptive_eager import compiler, replay

    runners = []
    init = compiler.GraphRunner.__init__
    monkeypatch.setattr(compiler.GraphRunner, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), runners.append(self))[0])
    built = []
    structure = replay.Template.structure
    monkeypatch.setattr(replay.Template, "structure", lambda self, table: (built.append(1), structure(self, table))[1])

    def f(x, y):
        return (x @ y).relu() + 1

    g = torch.compile(f)
    x, y = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    g(x, y)
    (runner,) = runners
    cache = runner.sink.plan_cache
    hits = cache.hits
    for _ in range(4):
        g(x, y)
    assert cache.hits == hits + 4 and len(built) == 1  # the first replay's key, then none
    cache[("another",)] = None  # any change to the cache: the key is built again, once
    for _ in range(2):
        g(x, y)
    assert cache.hits == hits + 6 and len(built) == 2
    torch.testing.assert_close(g(x, y).cpu(), f(x.cpu(), y.cpu()))


def test_a_plan_cache_ticket_finds_its_entry_until_the_cache_changes():
    from adaptive_eager.fusion.caches import CountingLRU

    cache = CountingLRU(maxsize=2)
    cache[("a",)] = 1
    cache[("b",)] = 2
    value, ticket = cache.lookup_ticket(("a",))
    assert value == 1 and cache.hits == 1 and list(cache._data) == [("b",), ("a",)]
    assert cache.lookup(("b",)) == 2 and list(cache._data) == [("a",), ("b",)]
    assert cache.relookup(ticket) == 1 and cache.hits == 3  # counted, and now the most recent
    assert list(cache._data) == [("b",), ("a",)]
    assert cache.lookup_ticket(("c",)) == (None, None) and cache.misses == 1
    for change in (lambda: cache.__setitem__(("c",), 3), lambda: cache.pop(("c",)), cache.clear):
        value, ticket = cache.lookup_ticket(next(iter(cache._data))) if len(cache) else (None, None)
        change()
        if ticket is not None:
            assert cache.relookup(ticket) is None  # the cache changed: look the key up again
