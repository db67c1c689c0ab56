"""The dependency graph's hazard edges (``fusion/window_graph.py``), one test per hazard.

Each test is a window where fusion, without the edge, would run an op before one it must
follow: a wrong number or a kernel count shows it. Each was checked by deleting its edge
(or the line that makes it) once; the test names say which.

Windows flush only at sync points, so each region below is one window; most use the loop
rules alone (no on-chip rule), where the opaque op in the middle cannot join a kernel and
the planner fuses around it.
"""
import pytest
import torch

import adaptive_eager
from conftest import windows_at_sync_points


@pytest.fixture
def loop_rules_only():
    adaptive_eager.enable()
    yield from windows_at_sync_points(on_chip_bytes=0)


@pytest.fixture
def one_window():
    adaptive_eager.enable()
    yield from windows_at_sync_points()


def launches(region):
    adaptive_eager.reset_stats()
    result = region()
    return result, adaptive_eager.stats()["kernels_launched"]


def test_read_after_write_is_what_fusion_follows(one_window):
    """raw: the chain fuses along its data flow into one kernel."""
    x = torch.randn(64).to("neuron")
    torch.neuron.synchronize()
    z, count = launches(lambda: ((x * 2 + 1).relu() * 3).cpu())
    assert count == 1
    torch.testing.assert_close(z, ((x.cpu() * 2 + 1).relu() * 3))


@pytest.mark.parametrize("rules", ["loop_rules_only", "one_window"])
def test_write_after_read_keeps_the_reader_first(rules, request):
    """war: ``y.add_(1)`` must wait for the matmul that reads ``y``; fused with ``y``'s
    producer it would run first."""
    request.getfixturevalue(rules)
    t, w = torch.randn(4, 4), torch.randn(4, 4)
    dt, dw = t.to("neuron"), w.to("neuron")
    torch.neuron.synchronize()
    y = dt * 2
    s = y @ dw
    y.add_(1)
    torch.testing.assert_close(s.cpu(), (t * 2) @ w)
    torch.testing.assert_close(y.cpu(), t * 2 + 1)


def test_write_after_write_through_an_in_place_op(loop_rules_only):
    """An in-place write makes the op its storage's last writer, so a later write reads
    after it (raw, which covers write after write): ``x.mul_(k)`` fused with ``k``'s
    producer must still follow ``x.add_(1)``."""
    x0, y0 = torch.randn(8), torch.randn(8)
    x, y = x0.to("neuron"), y0.to("neuron")
    both = torch.cat([x, x])  # x is read before the writes: the window is not trivial
    torch.neuron.synchronize()
    k = y * 3
    x.add_(1)
    x.mul_(k)
    torch.testing.assert_close(x.cpu(), (x0 + 1) * (y0 * 3))
    del both


def test_views_of_one_storage_overlap(loop_rules_only):
    """A view shares its base's storage, so a write through one view orders after reads
    through others that overlap it (a column and a row of ``y``) and after ``y``'s
    producer. Without that the update, which fuses with ``k``'s producer, would run first.
    (Checked by giving each view an identity of its own in ``device/ops/dispatch.py``.)"""
    t = torch.randn(4, 4)
    dt = t.to("neuron")
    torch.neuron.synchronize()
    k = dt[0] * 3
    y = dt * 2
    column_sum = torch.cat([y[:, 1], y[:, 2]]).sum()  # reads through views; cat is opaque
    y[1].add_(k)  # writes y[1, 1] and y[1, 2], which the sum read
    expected_y = t * 2
    expected_sum = torch.cat([expected_y[:, 1], expected_y[:, 2]]).sum()
    torch.testing.assert_close(column_sum.cpu(), expected_sum)
    expected_y[1] += t[0] * 3
    torch.testing.assert_close(y.cpu(), expected_y)


def test_random_ops_keep_their_order(loop_rules_only):
    """ordered: ``bernoulli`` fuses with the ops before ``rand_like`` and would draw first."""

    def program(device):
        torch.manual_seed(3)
        x = torch.linspace(0.1, 0.9, 16).to(device)
        if device == "neuron":
            torch.neuron.synchronize()
        k = x * 0.5
        first = torch.rand_like(x)
        second = torch.bernoulli(k.sigmoid())
        return first.cpu(), second.cpu()

    for a, b in zip(program("neuron"), program("cpu")):
        assert torch.equal(a, b)


def test_ops_after_a_fallible_op_never_run_before_it(loop_rules_only):
    """ordered: an update issued after a failing ``index_select``, fused with an op before
    it, would run before the failure and happen; it must be dropped like every op issued
    after the failure."""
    x = torch.randn(8).to("neuron")
    state = torch.zeros(8).to("neuron")
    bad_index = torch.tensor([0, 99]).to("neuron")
    torch.neuron.synchronize()
    k = x * 2
    bad = x.index_select(0, bad_index)  # fails on the device
    state.add_(k)  # issued after the failure
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="index_select"):
        torch.neuron.synchronize()
    assert state.cpu().tolist() == [0.0] * 8
    del bad
