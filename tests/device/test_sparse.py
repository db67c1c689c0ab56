"""Sparse COO tensors on the device (device/ops/sparse.py, device/csrc/sparse.cpp): each
result equals the CPU's, in strict and adaptive eager."""
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from conftest import assert_same


def _sparse_same(neuron_value, cpu_value):
    """Same layout, device, coalesced flag, indices and values as the CPU's sparse tensor."""
    assert neuron_value.layout == torch.sparse_coo and neuron_value.device.type == "neuron"
    assert neuron_value.is_coalesced() == cpu_value.is_coalesced()
    assert neuron_value.shape == cpu_value.shape
    assert_same(neuron_value._indices(), cpu_value._indices())
    assert_same(neuron_value._values(), cpu_value._values())


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "sparse_adam": lambda params: torch.optim.SparseAdam(params, lr=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


def _train_sparse_embedding(device, optimizer):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(device)
    head = torch.nn.Linear(4, 1).to(device)
    sparse_opt = OPTIMIZERS[optimizer](list(embedding.parameters()))
    dense_opt = torch.optim.SGD(head.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(1)
    for _ in range(4):
        index = torch.randint(0, 10, (3, 5), generator=batches).to(device)
        loss = head(embedding(index)).pow(2).mean()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        assert embedding.weight.grad.layout == torch.sparse_coo
        sparse_opt.step()
        dense_opt.step()
    return embedding.weight.detach(), head.weight.detach(), loss.detach()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sparse_embedding_training_equals_the_cpu_exactly(any_mode, optimizer):
    expected = _train_sparse_embedding("cpu", optimizer)
    result = _train_sparse_embedding("neuron", optimizer)
    for value, cpu_value in zip(result, expected):
        assert value.device.type == "neuron"
        assert torch.equal(value.cpu(), cpu_value)
    assert adaptive_eager.stats()["fallback_ops"]  # the sparse ops ran on the host, counted


def test_functional_embedding_sparse_gradient(any_mode):
    weight = torch.randn(6, 3)
    index = torch.tensor([[0, 2, 2], [5, 0, 1]])
    expected = weight.clone().requires_grad_()
    F.embedding(index, expected, sparse=True).mul(torch.arange(3.0)).sum().backward()
    result = weight.to("neuron").requires_grad_()
    F.embedding(index.to("neuron"), result, sparse=True).mul(torch.arange(3.0).to("neuron")).sum().backward()
    _sparse_same(result.grad, expected.grad)


def test_gather_sparse_grad_backward(any_mode):
    x = torch.randn(3, 4)
    index = torch.tensor([[0, 1], [2, 3], [1, 1]])
    expected = x.clone().requires_grad_()
    torch.gather(expected, 1, index, sparse_grad=True).pow(2).sum().backward()
    result = x.to("neuron").requires_grad_()
    torch.gather(result, 1, index.to("neuron"), sparse_grad=True).pow(2).sum().backward()
    _sparse_same(result.grad, expected.grad)
    assert_same(result.grad.to_dense(), expected.grad.to_dense())


def test_to_sparse_and_back(any_mode):
    x = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]])
    on_device = x.to("neuron").to_sparse()
    _sparse_same(on_device, x.to_sparse())
    assert_same(on_device.to_dense(), x)
    uploaded = x.to_sparse().to("neuron")  # a CPU sparse tensor moved to the device
    _sparse_same(uploaded, x.to_sparse())
    back = uploaded.cpu()
    assert back.device.type == "cpu" and back.layout == torch.sparse_coo
    assert torch.equal(back.to_dense(), x)
    _sparse_same(x.to("neuron").to_sparse(1), x.to_sparse(1))  # a dense dimension


def test_sparse_coo_tensor_on_the_device(any_mode):
    indices = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    values = torch.tensor([3.0, 4.0, 5.0, 1.0])
    expected = torch.sparse_coo_tensor(indices, values, (2, 3))
    made_here = torch.sparse_coo_tensor(indices, values, (2, 3), device="neuron")
    of_device_parts = torch.sparse_coo_tensor(indices.to("neuron"), values.to("neuron"), (2, 3))
    for result in (made_here, of_device_parts):
        _sparse_same(result, expected)
        _sparse_same(result.coalesce(), expected.coalesce())  # duplicates summed
        assert_same(result.to_dense(), expected.to_dense())


def test_sparse_and_dense_arithmetic(any_mode):
    dense = torch.randn(4, 3)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3, 3], [1, 0, 2]]), torch.randn(3), (4, 3))
    d, s = dense.to("neuron"), sparse.to("neuron")
    assert_same(d + s, dense + sparse)
    _sparse_same((s + s).coalesce(), (sparse + sparse).coalesce())
    _sparse_same(s * 2.5, sparse * 2.5)
    assert_same(torch.sparse.mm(s, d.t()), torch.sparse.mm(sparse, dense.t()))
    _sparse_same(d.sparse_mask(s.coalesce()), dense.sparse_mask(sparse.coalesce()))
    in_place, cpu_in_place = d.clone(), dense.clone()
    in_place.add_(s, alpha=-0.5)
    cpu_in_place.add_(sparse, alpha=-0.5)
    assert_same(in_place, cpu_in_place)
    grown, cpu_grown = s.clone(), sparse.clone()
    grown.add_(s)  # re-points the sparse tensor to new indices and values
    cpu_grown.add_(sparse)
    _sparse_same(grown, cpu_grown)


def test_values_are_the_values_tensor_itself(any_mode):
    # Adagrad's `std._values().sqrt_()` updates the sparse tensor in place, as on the CPU.
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([4.0, 9.0]), (3,)).coalesce()
    on_device = sparse.to("neuron")
    on_device._values().sqrt_()
    sparse._values().sqrt_()
    _sparse_same(on_device, sparse)


def test_sparse_tensor_memory_is_its_indices_and_values(strict_mode):
    torch.neuron.synchronize()
    before = torch.neuron.memory_allocated()
    parts = torch.tensor([[0, 1, 2]]).to("neuron"), torch.ones(3).to("neuron")
    dense_parts = torch.neuron.memory_allocated() - before
    del parts
    torch.neuron.synchronize()
    assert torch.neuron.memory_allocated() == before
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2]]), torch.ones(3), (5,), device="neuron")
    assert torch.neuron.memory_allocated() - before == dense_parts > 0
    del sparse
    torch.neuron.synchronize()
    assert torch.neuron.memory_allocated() == before


def test_a_sparse_op_raises_the_pending_deferred_error_first(strict_mode):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (3,), device="neuron")
    F.embedding(torch.tensor([9]).to("neuron"), torch.randn(4, 3).to("neuron"))  # deferred to the sync point
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="embedding"):
        sparse.to_dense()
    assert_same(sparse.to_dense(), torch.tensor([1.0, 1.0, 0.0]))  # raised once; the sparse op then runs


def test_bad_sparse_arguments_raise_the_cpus_error_at_the_call():
    indices, values = torch.tensor([[0, 5]]), torch.ones(2)
    with pytest.raises(RuntimeError) as cpu:
        torch.sparse_coo_tensor(indices, values, (3,), check_invariants=True)
    with pytest.raises(RuntimeError) as neuron:
        torch.sparse_coo_tensor(indices.to("neuron"), values.to("neuron"), (3,), check_invariants=True)
    assert str(neuron.value) == str(cpu.value)
    dense, sparse = torch.randn(2, 3), torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError) as cpu:
        dense + sparse
    with pytest.raises(RuntimeError) as neuron:
        dense.to("neuron") + sparse.to("neuron")
    assert str(neuron.value) == str(cpu.value)


def test_compressed_layouts_stay_refused():
    with pytest.raises(NotImplementedError, match="not supported on the neuron device"):
        torch.eye(3).to_sparse_csr().to("neuron")


def test_the_structure_moves_no_data_and_the_arithmetic_is_a_counted_fallback(strict_mode):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([4.0, 9.0]), (3,), device="neuron")
    adaptive_eager.reset_stats()
    sparse._indices(), sparse._values(), sparse._nnz(), sparse.is_coalesced(), sparse.sparse_dim()
    assert adaptive_eager.stats()["fallback_ops"] == {}
    sparse.coalesce()
    assert adaptive_eager.stats()["fallback_ops"] == {"aten::_coalesce": 1}


def test_no_fallback_makes_a_sparse_op_a_clear_error():
    from adaptive_eager_device.core.config import CONFIG

    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([4.0, 9.0]), (3,), device="neuron")
    CONFIG.fallback = False  # the fixture restores it
    with pytest.raises(NotImplementedError, match="aten::add on a sparse tensor .* NEURON_FALLBACK=0"):
        sparse + sparse


def test_save_load_and_deepcopy(tmp_path):
    import copy

    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    sparse = dense.to_sparse().to("neuron")
    torch.save(sparse, tmp_path / "sparse.pt")
    for result in (torch.load(tmp_path / "sparse.pt"), copy.deepcopy(sparse)):
        _sparse_same(result, dense.to_sparse())
