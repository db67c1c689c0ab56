"""Deferred device errors, per the contract: recorded on the queue, raised at the next sync
point with the earliest op's context, poisoned outputs, recovery, launch blocking."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager import NeuronRuntimeError, PoisonedTensorError
from adaptive_eager_device.core.config import CONFIG

pytestmark = pytest.mark.usefixtures("any_mode")  # every test, in strict and adaptive eager

THIS_FILE = os.path.basename(__file__)

FAULTS = {
    "embedding_index_out_of_range": (
        "aten::embedding",
        lambda d: F.embedding(torch.tensor([1, 7]).to(d), torch.randn(4, 3).to(d)),
    ),
    "index_select_out_of_range": (
        "aten::index_select",
        lambda d: torch.randn(4, 3).to(d).index_select(0, torch.tensor([0, 9]).to(d)),
    ),
    "gather_out_of_range": (
        "aten::gather",
        lambda d: torch.randn(3, 3).to(d).gather(1, torch.tensor([[0, 5, 1]] * 3).to(d)),
    ),
    "cross_entropy_target_out_of_range": (
        "aten::nll_loss_forward",
        lambda d: F.cross_entropy(torch.randn(2, 4).to(d), torch.tensor([1, 6]).to(d)),
    ),
    "multinomial_negative_probabilities": (
        "aten::multinomial",
        lambda d: torch.multinomial(torch.tensor([0.5, -0.1, 0.6]).to(d), 2),
    ),
}


def cpu_error(fault):
    with pytest.raises(Exception) as info:
        fault("cpu")
    return info.value


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_is_deferred_to_the_next_sync_point(name):
    op_name, fault = FAULTS[name]
    expected = cpu_error(fault)
    result = fault("neuron")  # issued: no error yet
    with pytest.raises(NeuronRuntimeError) as info:
        torch.neuron.synchronize()
    message = str(info.value)
    assert op_name in message
    assert str(expected).splitlines()[0] in message  # the CPU's own error text
    assert re.search(rf"{THIS_FILE}:\d+", message), message  # the user's line
    assert "NEURON_LAUNCH_BLOCKING=1" in message
    assert isinstance(info.value, RuntimeError)
    assert info.value.op_name == op_name
    assert adaptive_eager.stats()["errors"] == {"deferred": 1, "raised": 1}
    with pytest.raises(PoisonedTensorError, match=op_name):
        result.cpu()


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_launch_blocking_raises_at_the_faulty_op(name):
    op_name, fault = FAULTS[name]
    CONFIG.launch_blocking = True
    with pytest.raises(NeuronRuntimeError, match=re.escape(op_name)):
        fault("neuron")


def test_a_failure_drops_what_was_issued_after_it_until_the_sync_point():
    """TorchNeuron's first error wins, and the queue is dropped after it (torch_npu): the
    ops issued after the failing op and before the sync point do not happen. Their fresh
    outputs are poisoned; what they update in place keeps its value."""
    x = torch.arange(6.0).to("neuron")
    state = torch.zeros(6).to("neuron")
    before = x * 2  # issued before the failure: keeps its value
    bad = F.embedding(torch.tensor([9]).to("neuron"), torch.randn(4, 3).to("neuron"))
    downstream = bad.sum() + 1  # reads the failed output: dropped
    independent = x + 1  # issued after the failure: dropped too
    state.add_(1)  # an in-place update issued after it: does not happen
    with pytest.raises(NeuronRuntimeError, match="aten::embedding"):
        downstream.item()
    assert before.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert state.cpu().tolist() == [0.0] * 6
    for poisoned in (bad, downstream, independent):
        with pytest.raises(PoisonedTensorError, match=r"aten::embedding.*index out of range"):
            poisoned.cpu()
    stats = adaptive_eager.stats()
    assert stats["kernels_skipped"] == 4  # sum, add, add, add_
    # the device works again
    assert (x + 10).cpu().tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert state.add(1).cpu().tolist() == [1.0] * 6


def test_a_kernel_reading_a_poisoned_tensor_later_fails_and_names_the_original():
    """After the error was raised, a kernel that reads a poisoned tensor is an error of
    its own (never a silently skipped update)."""
    weights = torch.ones(3).to("neuron")
    bad = torch.randn(3).to("neuron").index_select(0, torch.tensor([5]).to("neuron"))
    with pytest.raises(NeuronRuntimeError):
        torch.neuron.synchronize()
    weights.add_(bad)  # reads the poisoned output: fails at the next sync point
    with pytest.raises(NeuronRuntimeError, match=r"(?s)aten::add_.*index_select") as info:
        torch.neuron.synchronize()
    assert re.search(rf"{THIS_FILE}:\d+", str(info.value))
    assert weights.cpu().tolist() == [1.0, 1.0, 1.0]


def test_only_the_earliest_failure_is_raised():
    a = F.embedding(torch.tensor([9]).to("neuron"), torch.randn(4, 3).to("neuron"))
    b = torch.randn(3).to("neuron").index_select(0, torch.tensor([5]).to("neuron"))  # dropped
    with pytest.raises(NeuronRuntimeError) as info:
        torch.neuron.synchronize()
    assert info.value.op_name == "aten::embedding"
    assert adaptive_eager.stats()["errors"] == {"deferred": 1, "raised": 1}
    torch.neuron.synchronize()  # cleared: nothing more to raise
    del a, b


def test_the_earliest_error_in_issue_order_wins_whatever_the_fusion():
    """Two failing ops in one window: the error raised is the first in issue order, in
    both modes. Adaptive eager fuses everything here into one kernel."""
    x = torch.randn(4, 3, device="neuron")
    a = torch.index_select(x, 0, torch.tensor([0, 7], device="neuron"))  # fails first
    b = torch.gather(x, 0, torch.tensor([[9, 0, 0]], device="neuron"))
    c = a.sum() + b.sum()
    with pytest.raises(NeuronRuntimeError) as info:
        torch.neuron.synchronize()
    assert info.value.op_name == "aten::index_select"
    del c


def test_an_earlier_failure_recorded_later_still_wins():
    """The worker may meet the failures out of issue order; the earliest issued wins."""
    from adaptive_eager_device.core.errors import FailureState, KernelFailure

    state = FailureState()
    later = KernelFailure("aten::gather", "", None, None, RuntimeError("b"), 2, issue=20)
    earlier = KernelFailure("aten::index_select", "", None, None, RuntimeError("a"), 3, issue=10)
    state.record(later)
    state.record(earlier)
    assert state.take() is earlier


def _bad_batch_loop(model, optimizer, batches):
    """The issue's training loop: a batch with an index out of range fails at its sync
    point, the loop skips it and goes on."""
    losses, skipped = [], []
    for step, batch in enumerate(batches):
        try:
            loss = model(batch.to("neuron")).pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # the sync point: raises for the bad batch
        except NeuronRuntimeError:
            skipped.append(step)
            continue
    return losses, skipped


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_training_loop_can_skip_a_bad_batch_and_go_on(optimizer_name):
    """The failing embedding poisons the forward, the backward and the optimizer step are
    dropped: parameters and optimizer state are exactly as before the bad batch, so the
    run equals a CPU run that never saw it.

    AdamW is ``capturable``: its step counters live on the device. Without it PyTorch
    keeps them on the host, where they count the bad batch's step at once, out of any
    device's reach (docs/ARCHITECTURE.md, "Errors")."""

    def build(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 2)).to(device)
        make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, capturable=device != "cpu")}[optimizer_name]
        return model, make(model.parameters())

    good = [torch.tensor([[1, 2]]), torch.tensor([[4, 5]]), torch.tensor([[7, 3]])]
    model, optimizer = build("neuron")
    losses, skipped = _bad_batch_loop(model, optimizer, [good[0], torch.tensor([[3, 42]]), good[1], good[2]])
    assert skipped == [1]

    cpu_model, cpu_optimizer = build("cpu")
    cpu_losses = []
    for batch in good:
        loss = cpu_model(batch).pow(2).sum()
        cpu_optimizer.zero_grad()
        loss.backward()
        cpu_optimizer.step()
        cpu_losses.append(loss.item())
    assert losses == pytest.approx(cpu_losses, rel=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        for name, value in cpu_optimizer.state[q].items():
            torch.testing.assert_close(optimizer.state[p][name].cpu(), value, check_dtype=False)


def test_a_failure_inside_a_fused_kernel_drops_the_rest_and_keeps_in_place_targets():
    """An injected fault in the middle of a chain that adaptive eager fuses: the ops
    before it ran, the ops after it did not, the tensor the chain updates in place keeps
    its value; a failing in-place index write keeps its target as it was."""
    target = torch.zeros(4).to("neuron")
    x = torch.arange(4.0).to("neuron")
    adaptive_eager.inject_fault("aten::mul", 1)
    y = x + 1
    z = y * 2  # fails
    target.add_(z)
    with pytest.raises(NeuronRuntimeError, match="aten::mul"):
        torch.neuron.synchronize()
    assert y.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert target.cpu().tolist() == [0.0] * 4
    adaptive_eager.clear_faults()
    # a real failure in the middle of an in-place write: index_put_ checks each index as
    # it writes, so the device restores what it wrote before the bad one
    values = torch.tensor([5.0, 6.0, 7.0]).to("neuron")
    target.index_put_((torch.tensor([0, 1, 9]).to("neuron"),), values)
    with pytest.raises(NeuronRuntimeError, match="aten::index_put_"):
        torch.neuron.synchronize()
    assert target.cpu().tolist() == [0.0] * 4


def test_injected_fault_names_the_exact_op(monkeypatch):
    adaptive_eager.inject_fault("aten::mul", 2)
    x = torch.ones(3, device="neuron")
    y = x * 2  # first mul: fine
    z = y * 3  # second mul: fails
    with pytest.raises(NeuronRuntimeError, match=r"(?s)aten::mul.*injected fault") as info:
        z.cpu()
    assert re.search(rf"{THIS_FILE}:\d+", str(info.value))
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


def test_host_side_errors_raise_immediately_not_deferred():
    with pytest.raises(RuntimeError, match="size of tensor a"):
        torch.ones(2, device="neuron") + torch.ones(3, device="neuron")
    assert adaptive_eager.stats()["errors"] == {"deferred": 0, "raised": 0}


def test_error_from_backward_names_the_autograd_node():
    weight = torch.randn(4, 3, device="neuron", requires_grad=True)
    adaptive_eager.inject_fault("aten::embedding_dense_backward", 1)
    out = F.embedding(torch.tensor([1, 2]).to("neuron"), weight)
    out.sum().backward()
    with pytest.raises(NeuronRuntimeError, match=r"(?s)embedding_dense_backward.*autograd backward: EmbeddingBackward0"):
        torch.neuron.synchronize()
