"""Deferred device errors, per the contract: recorded on the queue, raised at the next sync
point with the earliest op's context, poisoned outputs, recovery, launch blocking."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager import NeuronRuntimeError, PoisonedTensorError
from adaptive_eager.device.config import CONFIG

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


def test_poisoning_follows_data_and_spares_the_rest():
    x = torch.arange(6.0).to("neuron")
    before = x * 2  # computed before the failure: keeps its value
    bad = F.embedding(torch.tensor([9]).to("neuron"), torch.randn(4, 3).to("neuron"))
    downstream = bad.sum() + 1  # reads the failed output: skipped, poisoned
    independent = x + 1  # unrelated work still runs
    with pytest.raises(NeuronRuntimeError, match="aten::embedding"):
        downstream.item()
    assert before.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert independent.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    for poisoned in (bad, downstream):
        with pytest.raises(PoisonedTensorError, match=r"aten::embedding.*index out of range"):
            poisoned.cpu()
    stats = adaptive_eager.stats()
    assert stats["kernels_skipped"] == 2  # sum and add read poisoned data
    # the device works again
    assert (x + 10).cpu().tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]


def test_only_the_earliest_failure_is_raised_later_ones_are_counted():
    a = F.embedding(torch.tensor([9]).to("neuron"), torch.randn(4, 3).to("neuron"))
    b = torch.randn(3).to("neuron").index_select(0, torch.tensor([5]).to("neuron"))
    with pytest.raises(NeuronRuntimeError) as info:
        torch.neuron.synchronize()
    assert info.value.op_name == "aten::embedding"
    assert adaptive_eager.stats()["errors"] == {"deferred": 2, "raised": 1}
    torch.neuron.synchronize()  # cleared: nothing more to raise
    del a, b


def test_training_loop_can_skip_a_bad_batch_and_go_on():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 2)).to("neuron")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.tensor([[1, 2]]), torch.tensor([[3, 42]]), torch.tensor([[4, 5]])]  # 42: out of range
    losses, skipped = [], []
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch.to("neuron")).pow(2).mean()
        try:
            value = loss.item()
        except NeuronRuntimeError:
            skipped.append(step)
            continue
        loss.backward()
        optimizer.step()
        losses.append(value)
    assert skipped == [1] and len(losses) == 2
    for p in model.parameters():
        assert torch.isfinite(p.detach().cpu()).all()


def test_injected_fault_names_the_exact_op(monkeypatch):
    adaptive_eager.inject_fault("aten::mul", 2)
    x = torch.ones(3, device="neuron")
    y = x * 2  # first mul: fine
    z = y * 3  # second mul: fails
    with pytest.raises(NeuronRuntimeError, match=r"(?s)aten::mul.*injected fault") as info:
        z.cpu()
    assert re.search(rf"{THIS_FILE}:\d+", str(info.value))
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


def test_fault_injection_from_the_environment(tmp_path):
    import subprocess
    import sys

    code = (
        "import torch, adaptive_eager\n"
        "x = torch.ones(2, device='neuron')\n"
        "y = x + 1\n"
        "try:\n"
        "    y.cpu()\n"
        "except adaptive_eager.NeuronRuntimeError as error:\n"
        "    print('raised', error.op_name)\n"
    )
    env = dict(os.environ, NEURON_SIM_FAULT="aten::add:1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "raised aten::add"


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
