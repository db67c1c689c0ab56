"""The adaptive window (``adaptive_eager/window.py``): its flush policy, read live from the
configuration, and its plan cache, keyed by the window's structure."""
import pytest
import torch
import torch.nn as nn

import adaptive_eager
from adaptive_eager.window import structure_key
from adaptive_eager_device.core.config import CONFIG
from conftest import assert_same, on_device, windows_at_sync_points


@pytest.fixture
def policy(adaptive_mode):
    """Adaptive eager, with the window flushed only at sync points (tests then set the
    fields they exercise; all are restored)."""
    yield from windows_at_sync_points(on_chip_bytes=0)


# -- the plan cache -----------------------------------------------------------------------


def test_plan_and_kernel_caches_hit_on_repeated_windows(policy):
    x = torch.randn(8)
    (d,) = on_device(x)
    adaptive_eager.clear_caches()
    adaptive_eager.reset_stats()
    for _ in range(5):
        ((d * 2 + 1).relu()).cpu()
    stats = adaptive_eager.stats()
    assert stats["plan_cache"]["misses"] == 1 and stats["plan_cache"]["hits"] == 4
    assert stats["kernel_cache"]["misses"] + stats["kernel_cache"]["hits"] == 1



# -- a plan's native program, shared by its windows -------------------------------------------


def _on_device_then_count_builds(monkeypatch, x):
    """``x`` on the device (its upload's window flushed), then the list the native programs
    built from now on append to."""
    (d,) = on_device(x)
    torch.neuron.synchronize()
    return d, _programs_built(monkeypatch)


def _programs_built(monkeypatch):
    from adaptive_eager_device.hardware import fused_kernel

    built = []
    builder = fused_kernel._native.ProgramBuilder

    def counting():
        built.append(1)
        return builder()

    monkeypatch.setattr(fused_kernel._native, "ProgramBuilder", counting)
    return built


def test_windows_of_one_plan_share_its_native_program(policy, monkeypatch):
    x = torch.randn(8)
    d, built = _on_device_then_count_builds(monkeypatch, x)
    for _ in range(5):
        assert_same((d * 2 + 1).relu(), (x * 2 + 1).relu())
    assert len(built) == 1  # the first window builds it; the other four bind it to their storages


@pytest.mark.parametrize("first, second", [(0.5, 0.25), (0.0, -0.0), (3, 3.0), (True, 1)],
                         ids=["float_value", "signed_zero", "int_vs_float", "bool_vs_int"])
def test_a_program_is_shared_only_by_windows_with_the_same_constants(policy, monkeypatch, first, second):
    """The plan is keyed by the signature, which keeps only a float's class (0.5 and 0.25 plan
    alike); the program bakes the value in, so windows differing there build their own."""
    x = torch.randn(8)
    d, built = _on_device_then_count_builds(monkeypatch, x)
    for scalar in (first, second, first, second):
        got = (d.add(1.0) * scalar).cpu()
        expected = x.add(1.0) * scalar
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit()), scalar
    assert len(built) == 2


def test_a_program_is_shared_only_by_windows_reading_the_same_places(policy, monkeypatch):
    """A view's offset in its storage is baked into the program, not into the plan."""
    x = torch.arange(16.0)
    d, built = _on_device_then_count_builds(monkeypatch, x)
    for start in (0, 4, 0, 8):
        assert_same(d[start:start + 4] * 2 + 1, x[start:start + 4] * 2 + 1)
    assert len(built) == 3


# -- flushes --------------------------------------------------------------------------------


def test_window_full_stream_change_and_queue_shallow_flushes(policy):
    x = torch.randn(8)
    (d,) = on_device(x)
    policy.max_ops = 4
    y = d
    for _ in range(10):
        y = y + 1
    policy.max_ops = 10**6
    with torch.neuron.stream(torch.neuron.Stream()):
        z = y * 2
    policy.min_ops, policy.shallow_us = 2, 10**9  # always "starved": flush early
    w = z - 1
    w = w - 1
    w = w - 1
    assert_same(w, x + 10 - 3 if False else (x + 10) * 2 - 3)
    reasons = adaptive_eager.stats()["flushes"]["by_reason"]
    assert reasons["window_full"] == 2
    assert reasons["stream_change"] >= 1
    assert reasons["queue_shallow"] >= 1


def test_queue_shallow_never_splits_a_multi_tensor_chain(policy):
    """The policy flushes when the device starves, but not between two foreach ops: an
    optimizer step stays one window, so one kernel (split, AdamW moved 12 tensors' bytes
    per parameter in 4 kernels instead of 7 in 1)."""
    cpu = [nn.Parameter(torch.randn(shape)) for shape in ((64, 32), (32,))]
    params = [nn.Parameter(p.detach().to("neuron")) for p in cpu]
    for p, q in zip(params, cpu):
        q.grad = torch.randn(q.shape)
        p.grad = q.grad.to("neuron")
    optimizers = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (params, cpu)]
    for optimizer in optimizers:
        optimizer.step()
    torch.neuron.synchronize()
    policy.min_ops, policy.shallow_us = 2, 10**9  # always "starved": flush at 2 ops
    adaptive_eager.reset_stats()
    for optimizer in optimizers:
        optimizer.step()
    for p, q in zip(params, cpu):
        assert_same(p.detach(), q.detach())
    stats = adaptive_eager.stats()
    assert stats["ops_recorded"] >= 8 and stats["kernels_launched"] == 1, stats["flushes"]
    assert stats["bytes_moved"] == 7 * sum(q.numel() * 4 for q in cpu)


# -- the policy: the configuration's values, live ------------------------------------------


def test_window_policy_is_the_configuration_read_live_and_restored():
    """``window_policy`` sets the configuration's ``NEURON_ADAPTIVE_*`` values for a region
    and restores every field afterwards, also one a test changed inside the region."""
    fields = {"max_ops": "window_ops", "min_ops": "min_window_ops", "shallow_us": "shallow_us",
              "patterns": "patterns", "on_chip_bytes": "on_chip_bytes"}
    before = {name: getattr(CONFIG, attribute) for name, attribute in fields.items()}
    with pytest.raises(ValueError):
        with adaptive_eager.window_policy(max_ops=3, patterns=False) as policy:
            assert (policy.max_ops, policy.patterns) == (3, False)
            assert (CONFIG.window_ops, CONFIG.patterns) == (3, False)
            policy.on_chip_bytes = 1  # a field changed inside the region is restored too
            assert CONFIG.on_chip_bytes == 1
            CONFIG.shallow_us = 123.0  # and the configuration, changed live, is what the policy reads
            assert policy.shallow_us == 123.0
            raise ValueError
    assert {name: getattr(CONFIG, attribute) for name, attribute in fields.items()} == before
    with pytest.raises(TypeError, match="window_policy: no field max_window"):
        with adaptive_eager.window_policy(max_window=3):
            pass


def test_a_configuration_change_reaches_the_next_window(adaptive_mode):
    """The window reads ``CONFIG.window_ops`` at each op, not a copy made at start."""
    saved = CONFIG.window_ops, CONFIG.min_window_ops
    try:
        CONFIG.window_ops, CONFIG.min_window_ops = 3, 10**6
        (d,) = on_device(torch.randn(4))
        y = d
        for _ in range(7):
            y = y + 1
        y.cpu()
        assert adaptive_eager.stats()["flushes"]["by_reason"]["window_full"] == 2
    finally:
        CONFIG.window_ops, CONFIG.min_window_ops = saved


# -- the plan-cache key -------------------------------------------------------------------


class _Storage:
    def __init__(self, alive=True):
        self.alive = alive


def test_the_key_numbers_storages_by_first_appearance_and_marks_escapes():
    a, b, c, out1, out2 = _Storage(), _Storage(alive=False), _Storage(), _Storage(), _Storage(alive=False)
    ops = [(7, (a, b), (), (out1,)), (9, (out1, a), (b,), (out2, None))]
    parts, later = structure_key(ops)
    # op 7 reads a=0, b=1, makes out1=2 (referenced: escapes, ~2); op 9 reads out1=2, a=0,
    # writes b=1 (no longer referenced: ~1), makes out2=3 (dead: 3) and no second tensor
    assert parts == [-7, 0, 1, ~2, -9, 2, 0, ~1, 3, None] and later == []
    del c


def test_the_key_leaves_writes_only_a_call_knows_for_later():
    """A compiled graph's template cannot know whether an input it writes is still
    referenced: those entries are listed, to be filled in at each call."""
    parts, later = structure_key([(3, (0,), (0,), (1,))], referenced=lambda n: None if n == 0 else True)
    assert parts == [-3, 0, 0, ~1] and later == [(2, 0)]


def test_the_same_structure_with_other_values_hits_the_plan_cache(policy):
    (d,) = on_device(torch.randn(8))
    adaptive_eager.clear_caches()
    (d * 2.0 + 1.0).cpu()
    (d * 3.0 - 1.0).cpu()  # other ops: another structure
    (d * 5.0 + 4.0).cpu()  # the first structure again, other float constants (their sign is in the key)
    stats = adaptive_eager.stats()["plan_cache"]
    assert (stats["misses"], stats["hits"]) == (2, 1)
