"""Adaptive eager's fusion rules: exact kernel counts per rule, numbers equal to CPU, and
negative tests named for what must not fuse and why."""
import logging

import networkx as nx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager.fusion.window_graph import would_create_cycle
from conftest import assert_same, on_device, windows_at_sync_points


@pytest.fixture(autouse=True)
def policy(adaptive_mode):
    """Adaptive eager, with the window flushed only at sync points: each test's ops form
    one window, so its kernel count depends on the fusion rules alone. The loop rules are
    tested on their own (on-chip fusion off), the on-chip rule at the end."""
    yield from windows_at_sync_points(on_chip_bytes=0)


def kernels():
    stats = adaptive_eager.stats()
    return stats["kernels_launched"], sorted(stats["kernels"])


# -- what fuses -------------------------------------------------------------------------


def test_pointwise_chain_fuses_into_one_kernel():
    x = torch.randn(8, 16)
    (d,) = on_device(x)
    assert_same((d * 2 + 1).relu(), (x * 2 + 1).relu())
    assert kernels() == (1, ["mul|add|relu"])
    stats = adaptive_eager.stats()
    assert stats["fused_kernels"] == 1 and stats["ops_fused"] == 3
    # two intermediates stay in registers: each saves a write and a read of 512 B
    assert stats["dead_intermediates"] == 2
    assert stats["bytes_saved"] == 2 * 2 * 8 * 16 * 4


def test_pointwise_chain_with_broadcasting_and_type_promotion():
    x, y, z = torch.randn(4, 8), torch.randn(8), torch.arange(4).view(4, 1)
    dx, dy, dz = on_device(x, y, z)
    assert_same(torch.sigmoid(dx * dy + dz) - dz, torch.sigmoid(x * y + z) - z)
    assert kernels() == (1, ["mul|add|sigmoid|sub"])


def test_reduction_fuses_with_its_prologue_and_epilogue():
    x = torch.randn(16, 32)
    (d,) = on_device(x)
    assert_same((d.exp() * 2).sum(-1).sqrt() + 1, (x.exp() * 2).sum(-1).sqrt() + 1)
    assert kernels() == (1, ["exp|mul|sum|sqrt|add"])


def test_matmul_fuses_with_bias_activation_and_residual_epilogue():
    a, w, b, r = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(8, 32)
    da, dw, db, dr = on_device(a, w, b, r)
    assert_same(F.relu(F.linear(da, dw, db)) + dr, F.relu(F.linear(a, w, b)) + r)
    assert kernels() == (1, ["addmm|relu|add"])


@pytest.mark.parametrize("name, make, compulsory", [
    # AdamW reads each parameter, gradient and both moments once and writes the
    # parameter and both moments once: 7 tensors' bytes per parameter
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), 7),
    # SGD with momentum: reads parameter, gradient, buffer; writes parameter, buffer
    ("SGD", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), 5),
])
def test_a_foreach_optimizer_step_is_one_kernel_with_its_compulsory_traffic(name, make, compulsory):
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (16, 8, 4)]
    cpu = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    params = [nn.Parameter(p.detach().to("neuron")) for p in cpu]
    for p, q in zip(params, cpu):
        q.grad = torch.randn(q.shape)
        p.grad = q.grad.to("neuron")
    optimizers = [make(params), make(cpu)]
    for _ in range(2):  # the first step creates the state
        optimizers[0].step()
        optimizers[1].step()
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    optimizers[0].step()
    optimizers[1].step()
    for p, q in zip(params, cpu):
        assert_same(p.detach(), q.detach())
    stats = adaptive_eager.stats()
    weights = sum(q.numel() * 4 for q in cpu)
    assert stats["kernels_launched"] == 1, (name, stats["refusals"])
    assert stats["bytes_moved"] == compulsory * weights


def test_random_ops_fuse_and_keep_the_cpu_numbers():
    x = torch.randn(64)
    (d,) = on_device(x)
    torch.manual_seed(5)
    result = F.dropout(d * 2, p=0.5, training=True) + 1
    torch.manual_seed(5)
    assert_same(result, F.dropout(x * 2, p=0.5, training=True) + 1)
    assert kernels()[0] == 1


def test_cat_fuses_with_the_ops_producing_its_inputs_and_reading_its_output():
    # Inductor's pointwise cat: each input is read once, the concatenation is never written
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    dx, dy = on_device(x, y)
    assert_same(torch.cat([dx * 2, dy + 1]).relu(), torch.cat([x * 2, y + 1]).relu())
    assert kernels() == (1, ["mul|add|cat|relu"])
    assert adaptive_eager.stats()["bytes_moved"] == 2 * x.nbytes + 2 * x.nbytes  # x, y in; the result out


def test_an_embedding_gather_fuses_with_its_epilogue_and_a_layer_norm():
    # token + position embeddings, added and normalized: one kernel, as GPT's first ops
    wte, wpe, w, b = torch.randn(50, 16), torch.randn(8, 16), torch.randn(16), torch.randn(16)
    idx, pos = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0)), torch.arange(8)
    tensors = on_device(wte, wpe, w, b, idx, pos)
    dwte, dwpe, dw, db, didx, dpos = tensors
    out = F.layer_norm(F.embedding(didx, dwte) + F.embedding(dpos, dwpe), (16,), dw, db)
    assert_same(out, F.layer_norm(F.embedding(idx, wte) + F.embedding(pos, wpe), (16,), w, b))
    assert kernels() == (1, ["embedding|embedding|add|native_layer_norm"])
    # the tables, indices, weight and bias read once, the output written once (the sum
    # and layer norm's mean and rstd stay on chip)
    assert adaptive_eager.stats()["bytes_moved"] == sum(t.nbytes for t in (wte, wpe, w, b, idx, pos)) + out.nbytes


def test_embedding_backward_is_a_scatter_add_reduction_with_its_prologue():
    grad, idx = torch.randn(2, 8, 16), torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    dgrad, didx = on_device(grad, idx)
    backward = torch.ops.aten.embedding_dense_backward
    out = backward(dgrad * 2, didx, 50, -1, False)
    assert_same(out, backward(grad * 2, idx, 50, -1, False))
    assert kernels() == (1, ["mul|embedding_dense_backward"])
    assert adaptive_eager.stats()["bytes_moved"] == grad.nbytes + idx.nbytes + out.nbytes


def test_cross_entropy_backward_is_one_reduction_with_its_prologue():
    # nll_loss_backward (a scatter into a zero gradient) is the prologue of
    # _log_softmax_backward_data: the log-probabilities read once, the gradient written once
    logits, target = torch.randn(32, 40), torch.randint(0, 40, (32,), generator=torch.Generator().manual_seed(0))
    leaf = logits.to("neuron").requires_grad_()
    (dtarget,) = on_device(target)
    loss = F.cross_entropy(leaf, dtarget)
    cpu_leaf = logits.clone().requires_grad_()
    F.cross_entropy(cpu_leaf, target).backward()
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    loss.backward()
    assert_same(leaf.grad, cpu_leaf.grad)
    launches, names = kernels()
    assert launches == 1, (names, adaptive_eager.stats()["refusals"])
    # + two scalars: nll_loss's total weight, read, and the loss's gradient (one), filled
    assert adaptive_eager.stats()["bytes_moved"] == 2 * logits.nbytes + target.nbytes + 2 * 4


# -- what must not fuse -----------------------------------------------------------------


def test_matmul_takes_no_prologue():
    a, w = torch.randn(8, 16), torch.randn(16, 4)
    da, dw = on_device(a, w)
    assert_same((da * 2) @ dw, (a * 2) @ w)
    assert kernels() == (2, ["aten::mm", "aten::mul"])
    assert adaptive_eager.stats()["refusals"] == {"a matmul takes no prologue": 1}


def test_two_reductions_do_not_share_a_kernel():
    x = torch.randn(8, 16)
    (d,) = on_device(x)
    assert_same(d.sum(-1).amax(), x.sum(-1).amax())
    assert kernels()[0] == 2
    assert "two anchors: reduction and reduction" in adaptive_eager.stats()["refusals"]


def test_opaque_op_runs_alone_between_fused_chains():
    weight, index = torch.randn(10, 4), torch.tensor([1, 3, 3])
    dw, di = on_device(weight, index)
    assert_same(torch.index_select(dw * 2, 0, di) + 1, torch.index_select(weight * 2, 0, index) + 1)
    assert kernels() == (3, ["aten::add", "aten::index_select", "aten::mul"])


def test_barrier_between_ops_blocks_fusion():
    x = torch.randn(16)
    (d,) = on_device(x)
    y = d * 2
    assert y.sum().item() == pytest.approx((x * 2).sum().item(), rel=1e-6)  # a sync point
    assert_same(y + 1, x * 2 + 1)
    launched, names = kernels()
    assert launched == 2 and names == ["add", "mul|sum"] or names == ["aten::add", "mul|sum"]
    assert adaptive_eager.stats()["flushes"]["by_reason"]["host_read"] >= 1


def test_value_read_after_inplace_write_through_view_sees_the_write():
    x = torch.randn(4, 6)
    (d,) = on_device(x)
    y_dev, y_cpu = d * 2, x * 2
    before_dev, before_cpu = y_dev.sum(), y_cpu.sum()  # reads y before the write
    y_dev[1].add_(10)  # in-place through a view of y
    y_cpu[1].add_(10)
    after_dev, after_cpu = y_dev.sum(), y_cpu.sum()  # reads y after the write
    assert_same(before_dev, before_cpu)
    assert_same(after_dev, after_cpu)
    assert_same(y_dev, y_cpu)


def test_escaping_intermediate_is_still_written_back():
    x = torch.randn(32)
    (d,) = on_device(x)
    kept = d * 3  # the user keeps this intermediate
    out = (kept + 1).relu()
    assert_same(out, (x * 3 + 1).relu())
    assert kernels() == (1, ["mul|add|relu"])
    stats = adaptive_eager.stats()
    assert stats["dead_intermediates"] == 1  # only kept + 1 stays in registers
    assert_same(kept, x * 3)


def test_an_in_place_write_to_a_buffer_nothing_references_is_not_written_back():
    """A buffer made in an earlier window, updated in place and let go before the flush
    (as autograd accumulates a gradient into a buffer and passes it on): its final value
    is unobservable, so the fused kernel reads it and never writes it back."""
    x = torch.randn(64)
    (d,) = on_device(x)
    buffer = d * 2
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    buffer.add_(1)
    total = buffer.sum()
    del buffer
    assert_same(total, (x * 2 + 1).sum())
    assert kernels() == (1, ["add_|sum"])
    assert adaptive_eager.stats()["bytes_moved"] == 64 * 4 + 4  # read once; only the sum written


def test_an_in_place_write_to_a_live_buffer_is_written_back():
    x = torch.randn(64)
    (d,) = on_device(x)
    buffer = d * 2
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    buffer.add_(1)
    total = buffer.sum()
    assert_same(total, (x * 2 + 1).sum())
    assert adaptive_eager.stats()["bytes_moved"] == 64 * 4 + 64 * 4 + 4  # read, written back, the sum
    assert_same(buffer, x * 2 + 1)


def test_the_plan_takes_its_cache_keys_escape_bits(monkeypatch):
    """A plan is cached under its window's key, so it must be made from the escape bits
    that key holds: a buffer still referenced when the key is built is charged as written
    back even if it is let go before the planner runs (a collection, another thread), as
    every later window with that key, whose buffer lives on, will reuse the plan."""
    import adaptive_eager.window as window

    planner = window.plan_window

    def released_while_planning(records, *args, **kwargs):
        (storage,) = records[0].writes
        storage.alive = False  # what a collection during planning would do
        try:
            return planner(records, *args, **kwargs)
        finally:
            storage.alive = True

    x = torch.randn(64)
    (d,) = on_device(x)
    buffer = d * 2
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    monkeypatch.setattr(window, "plan_window", released_while_planning)
    buffer.add_(1)
    total = buffer.sum()
    assert_same(total, (x * 2 + 1).sum())
    assert adaptive_eager.stats()["bytes_moved"] == 64 * 4 + 64 * 4 + 4  # read, written back, the sum
    assert_same(buffer, x * 2 + 1)


def test_intermediate_saved_for_backward_is_written_back():
    x = torch.randn(16, requires_grad=True)
    d = x.detach().to("neuron").requires_grad_()
    torch.neuron.synchronize()
    (torch.tanh(d * 2) * 3).sum().backward()  # tanh's output is saved for backward
    (torch.tanh(x * 2) * 3).sum().backward()
    assert_same(d.grad, x.grad)


def test_cycle_making_merge_is_refused():
    # mul -> index_select (opaque) -> add, and mul -> add: fusing mul with add would put
    # the index_select both before and after their kernel.
    weight, index = torch.randn(6, 4), torch.tensor([5, 0, 2, 2, 1, 3])
    dw, di = on_device(weight, index)
    a = dw * 2
    c = torch.index_select(a, 0, di)  # opaque, reads a
    out = a + c  # reads a and c
    assert_same(out, weight * 2 + torch.index_select(weight * 2, 0, index))
    assert adaptive_eager.stats()["refusals"].get("would create a cycle", 0) >= 1
    assert kernels()[0] == 3


def test_would_create_cycle_is_a_bfs_from_the_groups_outside_users():
    graph = nx.DiGraph([(0, 1), (1, 2), (0, 2), (2, 3)])
    assert would_create_cycle(graph, {0}, {2})  # 0 -> 1 -> 2: 1 would be inside and out
    assert not would_create_cycle(graph, {0}, {1})
    assert not would_create_cycle(graph, {1}, {2})
    assert not would_create_cycle(graph, {0, 1}, {2})
    assert not would_create_cycle(graph, {2}, {3})
    # through another kernel: 0 -> 1 and 2 -> 3 where {1, 2} already run as one kernel
    split = nx.DiGraph([(0, 1), (2, 3), (0, 3)])
    groups = {0: [0], 1: [1, 2], 2: [1, 2], 3: [3]}
    assert not would_create_cycle(split, {0}, {3})  # node by node, no path comes back
    assert would_create_cycle(split, {0}, {3}, groups.__getitem__)  # but kernel {1, 2} does


def test_refusals_are_logged_at_debug(caplog):
    a, w = torch.randn(4, 4), torch.randn(4, 4)
    da, dw = on_device(a, w)
    with caplog.at_level(logging.DEBUG, logger="adaptive_eager.fusion"):
        adaptive_eager.reset_stats()
        adaptive_eager.clear_caches()
        ((da * 2) @ dw).cpu()
    assert any("a matmul takes no prologue" in message for message in caplog.messages)


# -- caches, failure, determinism ---------------------------------------------------------


def test_failed_fused_kernel_names_the_exact_op_and_becomes_unfusable():
    x = torch.randn(8)
    (d,) = on_device(x)
    adaptive_eager.inject_fault("aten::add", 1)
    out = (d * 2 + 1).relu()
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match=r"(?s)aten::add \(inside fused kernel 'mul\|add\|relu'\).*test_fusion_rules.py:\d+") as info:
        out.cpu()
    assert info.value.op_name == "aten::add"
    again = (d * 2 + 1).relu()  # the same chain: replayed op by op, now unfused
    assert_same(again, (x * 2 + 1).relu())
    stats = adaptive_eager.stats()
    assert stats["replays"] == 1
    assert "marked unfusable after a failure" in stats["refusals"]


# -- the on-chip rule ---------------------------------------------------------------------


def test_small_working_set_fuses_across_anchors_on_chip(policy):
    policy.on_chip_bytes = 24 << 20  # one NeuronCore's SBUF
    x, w = torch.randn(1, 32), torch.randn(32, 32)
    dx, dw = on_device(x, w)
    h = F.layer_norm(dx, (32,))
    out = torch.softmax(h @ dw, -1) @ dw  # reduction, matmul, reduction, matmul
    expected = torch.softmax(F.layer_norm(x, (32,)) @ w, -1) @ w
    assert_same(out, expected)
    assert kernels() == (1, ["native_layer_norm|mm|_softmax|mm"])


def test_large_working_set_keeps_the_loop_rules(policy):
    policy.on_chip_bytes = 24 << 20
    x, w = torch.randn(2048, 1024), torch.randn(1024, 1024)  # 8 MiB + 4 MiB + 8 MiB outputs
    dx, dw = on_device(x, w)
    out = torch.softmax((dx * 2) @ dw, -1)
    assert_same(out, torch.softmax((x * 2) @ w, -1), rtol=1e-4, atol=1e-5)
    assert kernels()[0] == 3
    assert "a matmul takes no prologue" in adaptive_eager.stats()["refusals"]


def test_adaptive_records_exactly_the_ops_strict_records():
    # The window must not change what PyTorch does: e.g. holding output tensors would
    # stop autograd from stealing fresh gradient buffers, adding a copy_ per parameter.
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench.workloads import GPTBlock

    def ops(adaptive):
        with adaptive_eager.mode(adaptive):
            torch.manual_seed(0)
            block = GPTBlock(32, 4).to("neuron")
            x = torch.randn(2, 16, 32).to("neuron")
            block(x).sum().backward()  # warm-up: caches and optimizer-free grads
            block.zero_grad(set_to_none=True)
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            block(x).sum().backward()
            torch.neuron.synchronize()
            return adaptive_eager.stats()["ops_recorded"]

    assert ops(True) == ops(False)


def test_independent_copies_of_a_chain_fuse_horizontally():
    # What an optimizer step issues: the same chain for every parameter.
    params = [torch.randn(n) for n in (8, 16, 32)]
    grads = [torch.randn(n) for n in (8, 16, 32)]
    device_params, device_grads = on_device(*params), on_device(*grads)
    for p, g in zip(device_params, device_grads):
        p.mul_(0.9).add_(g, alpha=-0.1)
    for p, g in zip(params, grads):
        p.mul_(0.9).add_(g, alpha=-0.1)
    assert_same(device_params, params)
    assert kernels() == (1, ["mul_|add_ x3"])


def test_dependent_chains_do_not_fuse_horizontally():
    weight, index = torch.randn(6, 4), torch.tensor([3, 1])
    dw, di = on_device(weight, index)
    first = (dw * 2).exp()
    second = (torch.index_select(first, 0, di) * 2).exp()  # the same chain, after an opaque op reading the first
    assert_same(second, (torch.index_select((weight * 2).exp(), 0, index) * 2).exp())
    assert kernels() == (3, ["aten::index_select", "mul|exp"])
    assert adaptive_eager.stats()["kernels"]["mul|exp"]["launches"] == 2
