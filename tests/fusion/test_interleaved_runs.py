"""A fused window's run of multi-tensor ops (an optimizer step) runs parameter by parameter
on the worker (device/hardware/interleave.py: interleaved_runs; executor.cpp:
run_interleaved), and so do strict eager's consecutive launches of such ops
(executor.cpp: run_strict_interleaved): the same bits as PyTorch's order, only where no
tensor a run writes appears at two parameters, and a run that breaks after it began fails
with what it writes poisoned."""
import pytest
import torch

import adaptive_eager
from adaptive_eager_device import _C as _native
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware import fused_kernel, interleave, op_record
from adaptive_eager_device.hardware.execution_queue import QUEUE
from adaptive_eager_device.memory.storage import DeviceStorage
from adaptive_eager_device.ops.dispatch import install_native_recorder


def _interleaved() -> int:
    torch.neuron.synchronize()
    return QUEUE.native_counts()["interleaved_runs"]


def _train(mode: str, optimizer, steps: int = 3, dtype=torch.float32):
    """Parameters and optimizer state after ``steps`` steps; ``mode`` "cpu": the multi-tensor
    implementation on the CPU (``foreach=True``: PyTorch's order, each op over every
    parameter before the next), as PyTorch gives the device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dtype)
    device = "cpu" if mode == "cpu" else "neuron"
    model.to(device)
    opt = optimizer(model.parameters())
    adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    x = torch.randn(16, 32, dtype=dtype).to(device)
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    torch.neuron.synchronize()
    return [p.detach().cpu() for p in model.parameters()] + [
        v.cpu() for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


OPTIMIZERS = [
    lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
]


@pytest.mark.parametrize("mode", ["adaptive", "strict"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["adamw", "adam-l2", "sgd-nesterov"])
def test_an_optimizer_step_runs_parameter_by_parameter_with_pytorchs_bits(optimizer, mode):
    before = _interleaved()
    device = _train(mode, optimizer)
    ran = _interleaved() - before
    cpu = _train("cpu", optimizer)
    assert ran >= 2  # (the first step's momentum buffers are made, not updated: it may not interleave)
    assert all(torch.equal(a, c) for a, c in zip(device, cpu))
    adaptive_eager.disable()


@pytest.mark.parametrize("mode", ["adaptive", "strict"])
def test_bfloat16_parameters_interleave_too(mode):
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True)  # noqa: E731
    before = _interleaved()
    device = _train(mode, adamw, dtype=torch.bfloat16)
    assert _interleaved() - before >= 2
    assert all(torch.equal(a, c) for a, c in zip(device, _train("cpu", adamw, dtype=torch.bfloat16)))
    adaptive_eager.disable()


def test_a_strict_run_takes_the_batches_rung_after_its_own(strict_mode):
    """A multi-tensor launch over 1 MiB of traffic rings the doorbell alone; a run reaching
    the end of its batch takes the batches the host has rung since (executor.cpp:
    take_pending), as the worker of a training step finds the whole optimizer step rung."""
    import threading

    from conftest import _Hold

    params = [torch.randn(1 << 17, device="neuron") for _ in range(2)]  # 512 KiB each
    expected = [p.cpu() for p in params]
    torch.neuron.synchronize()
    before = _interleaved()
    gate = threading.Event()
    QUEUE.submit(_Hold(gate))  # the worker waits until the three launches are rung
    QUEUE.ring()
    try:
        for op, value in ((torch._foreach_mul_, 0.5), (torch._foreach_add_, 1.0), (torch._foreach_mul_, 2.0)):
            op(params, value)
            assert QUEUE._batch == []  # rung alone: 2 MiB read and written
            op(expected, value)
    finally:
        gate.set()
    assert _interleaved() - before == 1
    assert all(torch.equal(p.cpu(), e) for p, e in zip(params, expected))


def test_a_strict_launch_handed_back_broken_fails_with_what_it_writes_poisoned(monkeypatch):
    """The worker hands each launch of a strict run back with BROKEN when a step raises after
    the run began (executor.cpp: run_strict_interleaved): it fails, what it writes is
    poisoned, and the sync point raises the first one's failure."""
    params = [torch.randn(4, device="neuron") for _ in range(2)]
    torch.neuron.synchronize()
    _native.install_record(None)  # every op through the Python recorder, whose launches are patched here
    try:
        monkeypatch.setattr(CONFIG, "native", False)  # each launch a Python item
        monkeypatch.setattr(op_record.OpRecord, "execute",
                            lambda record, queue: op_record.OpRecord.resume(record, queue, interleave.BROKEN, None))
        torch._foreach_mul_(params, 0.5)
        with pytest.raises(RuntimeError, match=r"_foreach_mul_.*parameter by parameter"):
            torch.neuron.synchronize()
        with pytest.raises(RuntimeError, match="poisoned|parameter by parameter"):
            params[1].cpu()
    finally:
        install_native_recorder()


def _storage(n: int = 4) -> DeviceStorage:
    return DeviceStorage((n,), (1,), torch.float32, 4 * n)


def _parts(op, args, results=(), writes=()):
    return op, args, {}, list(results), list(writes)


def test_a_run_is_only_multi_tensor_ops_over_as_many_floating_parameters():
    p, q, g, h = (_storage() for _ in range(4))
    mul = _parts(torch.ops.aten._foreach_mul_.Scalar, [[p, q], 0.5], writes=[p, q])
    add = _parts(torch.ops.aten._foreach_add_.List, [[p, q], [g, h]], writes=[p, q])
    s1, s2 = _storage(), _storage()
    sqrt = _parts(torch.ops.aten._foreach_sqrt.default, [[p, q]], results=[s1, s2])
    assert interleave.interleaved_runs([mul, add, sqrt], set(), {}) == {0: 3}
    assert interleave.interleaved_runs([mul], set(), {}) == {}  # one op: nothing to gain
    norm = _parts(torch.ops.aten._foreach_norm.Scalar, [[p, q], 2], results=[s1, s2])
    assert interleave.interleaved_runs([mul, norm, add], set(), {}) == {}  # a reduction ends the run
    three = _parts(torch.ops.aten._foreach_mul_.Scalar, [[p, q, g], 0.5], writes=[p, q, g])
    assert interleave.interleaved_runs([mul, three], set(), {}) == {}  # another parameter count
    ints = DeviceStorage((4,), (1,), torch.int64, 32), DeviceStorage((4,), (1,), torch.int64, 32)
    int_mul = _parts(torch.ops.aten._foreach_mul_.Scalar, [list(ints), 2], writes=list(ints))
    int_add = _parts(torch.ops.aten._foreach_add_.Scalar, [list(ints), 1], writes=list(ints))
    assert interleave.interleaved_runs([int_mul, int_add], set(), {}) == {}  # integer division may raise
    assert interleave.interleaved_runs([mul, add, sqrt], {1}, {}) == {}  # a library kernel's op


def test_a_tensor_written_at_two_parameters_keeps_pytorchs_order():
    p, q, g = (_storage() for _ in range(3))
    shared = _parts(torch.ops.aten._foreach_add_.List, [[p, q], [q, g]], writes=[p, q])  # q: at 1, read at 0
    mul = _parts(torch.ops.aten._foreach_mul_.Scalar, [[p, q], 0.5], writes=[p, q])
    assert interleave.interleaved_runs([mul, shared], set(), {}) == {}
    read_twice = _parts(torch.ops.aten._foreach_add_.List, [[p, q], [g, g]], writes=[p, q])  # g read at both
    assert interleave.interleaved_runs([mul, read_twice], set(), {}) == {0: 2}
    scale = _storage(1)
    by_tensor = _parts(torch.ops.aten._foreach_mul_.Tensor, [[p, q], scale], writes=[p, q])
    writes_scale = _parts(torch.ops.aten._foreach_add_.Scalar, [[scale, g], 1.0], writes=[scale, g])
    assert interleave.interleaved_runs([by_tensor, mul], set(), {}) == {0: 2}
    assert interleave.interleaved_runs([by_tensor, writes_scale], set(), {}) == {}


@pytest.mark.parametrize("mode", ["adaptive", "strict"])
def test_views_of_one_buffer_written_at_two_parameters_keep_pytorchs_order(mode):
    """Parameters that are views of one flat buffer (as some wrappers lay them out): the
    update of one must not run ahead of another's, so the window's ops (strict eager's
    launches) run in order."""
    flat = torch.zeros(64, device="neuron")
    params = [flat[:32].view(4, 8), flat[32:].view(4, 8)]
    grads = [torch.randn(4, 8, device="neuron") for _ in params]
    adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    try:
        before = _interleaved()
        for _ in range(3):
            torch._foreach_mul_(params, 0.9)
            torch._foreach_add_(params, grads, alpha=0.1)
        assert _interleaved() == before
    finally:
        adaptive_eager.disable()
    expected = torch.zeros(64)
    cpu = [expected[:32].view(4, 8), expected[32:].view(4, 8)]
    for _ in range(3):
        torch._foreach_mul_(cpu, 0.9)
        torch._foreach_add_(cpu, [g.cpu() for g in grads], alpha=0.1)
    assert torch.equal(flat.cpu(), expected)


def test_a_run_that_breaks_after_it_began_fails_with_what_it_writes_poisoned(monkeypatch):
    """The worker hands a window back at an interleaved run with BROKEN (executor.cpp:
    run_interleaved, when a step raises after the run began): the run's first op fails,
    every tensor the run writes is poisoned, and the sync point raises it."""
    params = [torch.randn(4, device="neuron") for _ in range(2)]
    grads = [torch.randn(4, device="neuron") for _ in range(2)]
    torch.neuron.synchronize()
    broken = []

    def hand_back(self, queue):  # as the worker would: the window from the run, BROKEN
        for launch, (members, spec) in enumerate(self.launches):
            if spec is not None and any("_foreach" in str(self.records[m].op) for m in members):
                start = next(o for o, m in enumerate(members) if "_foreach" in str(self.records[m].op))
                broken.append(launch)
                return self.resume(queue, launch << 20 | start | interleave.BROKEN, {})
        return self.resume(queue, 0, None)

    monkeypatch.setattr(fused_kernel.WindowLaunches, "native", lambda self: None)
    monkeypatch.setattr(fused_kernel.WindowLaunches, "execute", hand_back)
    adaptive_eager.enable()
    try:
        torch._foreach_mul_(params, 0.5)
        torch._foreach_add_(params, grads)
        with pytest.raises(RuntimeError, match="parameter by parameter"):
            torch.neuron.synchronize()
        assert broken == [0]
        with pytest.raises(RuntimeError, match="poisoned|parameter by parameter"):
            params[1].cpu()
    finally:
        adaptive_eager.disable()


@pytest.mark.parametrize("mode", ["adaptive", "strict"])
def test_one_tensor_at_two_parameters_gives_the_cpus_result(mode):
    """``[p, p]``: PyTorch's order scales p twice, then adds twice; parameter by parameter
    would interleave them. The window (strict eager's launches) keeps PyTorch's order."""
    p = torch.randn(8)
    g = torch.randn(8)
    on_device, grad = p.to("neuron"), g.to("neuron")
    adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    try:
        before = _interleaved()
        torch._foreach_mul_([on_device, on_device], 0.5)
        torch._foreach_add_([on_device, on_device], [grad, grad])
        assert _interleaved() == before
    finally:
        adaptive_eager.disable()
    torch._foreach_mul_([p, p], 0.5)
    torch._foreach_add_([p, p], [g, g])
    assert torch.equal(on_device.cpu(), p)
