"""Shared fixtures: every test starts with a drained queue, no pending error, zeroed
statistics, and the default switches."""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import adaptive_eager
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware.execution_queue import QUEUE


@pytest.fixture(autouse=True)
def clean_device():
    saved = (CONFIG.launch_blocking, CONFIG.fallback, adaptive_eager.is_enabled())
    QUEUE.drain()
    QUEUE.failures.take()
    adaptive_eager.reset_stats()
    yield
    CONFIG.launch_blocking, CONFIG.fallback, adaptive = saved
    try:
        adaptive_eager.synchronize()
    except adaptive_eager.NeuronRuntimeError:
        pass
    adaptive_eager.enable() if adaptive else adaptive_eager.disable()
    QUEUE.drain()
    QUEUE.failures.take()
    QUEUE.faults = None


@pytest.fixture(autouse=True)
def no_generated_kernels():
    """Compiled mode's fused kernels run their ATen ops (NEURON_COMPILED_INDUCTOR off): which
    code runs them otherwise depends on when a background compile ends, so results would
    not be bit for bit repeatable (and every compiled test would compile kernels).
    tests/compiled/test_generated_kernels.py turns it on."""
    saved = CONFIG.compiled_inductor
    CONFIG.compiled_inductor = False
    yield
    CONFIG.compiled_inductor = saved


@pytest.fixture(params=["strict", "adaptive"])
def any_mode(request):
    """Run the test in strict eager and again in adaptive eager."""
    adaptive_eager.enable() if request.param == "adaptive" else adaptive_eager.disable()
    adaptive_eager.reset_stats()
    return request.param


@pytest.fixture
def strict_mode():
    """Exact strict-eager counts: one op, one launch."""
    adaptive_eager.disable()
    adaptive_eager.reset_stats()


def on_device(*tensors):
    """Copies of CPU tensors on the device, uploaded and synchronized, with the statistics
    zeroed afterwards: a test's counts then start at its own ops."""
    out = [t.to("neuron") for t in tensors]
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    return out


def windows_at_sync_points(**policy_fields):
    """The body of a fixture (``yield from`` it): adaptive eager with its window flushed
    only at sync points, so each synchronized region is one window; ``policy_fields`` set
    more of the window policy. Yields the live policy: the whole of it (tests may change
    more fields) is restored afterwards, and the plan and kernel caches start and end
    empty."""
    adaptive_eager.clear_caches()
    with adaptive_eager.window_policy(min_ops=10**6, max_ops=10**6, **policy_fields) as policy:
        yield policy
    adaptive_eager.clear_caches()


@contextlib.contextmanager
def keeping_records():
    """A sink that keeps each record (both recorders hand theirs to it, Python's and C's) and
    launches it as strict eager does; yields the list, strict eager again afterwards."""
    from adaptive_eager_device.hardware import sink

    records = []

    class Keeping:
        name = "keeping"

        def record(self, record):
            records.append(record)
            sink.STRICT_SINK.record(record)

        def flush(self, reason):
            pass

    sink.set_sink(Keeping())
    try:
        yield records
    finally:
        sink.set_sink(sink.STRICT_SINK)


@pytest.fixture
def adaptive_mode():
    adaptive_eager.enable()
    adaptive_eager.reset_stats()


def assert_same(neuron_value, cpu_value, **tolerances):
    """Compare a neuron result with the CPU's: same dtype, shape and values."""
    if isinstance(neuron_value, torch.Tensor):
        assert neuron_value.device.type == "neuron", neuron_value.device
        torch.testing.assert_close(neuron_value.cpu(), cpu_value, **tolerances)
    elif isinstance(neuron_value, (list, tuple)):
        assert len(neuron_value) == len(cpu_value)
        for a, b in zip(neuron_value, cpu_value):
            assert_same(a, b, **tolerances)
    else:
        assert neuron_value == cpu_value


class _Hold:
    """A queue item that keeps the device worker waiting until its gate opens."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def execute(self, queue) -> None:
        self.gate.wait(10)


@pytest.fixture
def held_device():
    """The device worker is held back for 0.3 s: a kernel issued in the test has not run
    when the host reads its output, so a read that does not wait for it reads garbage."""
    gate = threading.Event()
    QUEUE.submit(_Hold(gate))
    QUEUE.ring()
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    yield
    gate.set()
    timer.cancel()


@pytest.fixture
def tiny_static_llama():
    """transformers' Llama, tiny, on the CPU: (model, prompt ids, the CPU's greedy static-cache
    generation of 6 new tokens)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 6))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    return model, ids, expected
