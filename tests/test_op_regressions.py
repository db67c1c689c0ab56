"""Ops that once went wrong on `neuron`, each checked against the CPU."""
import pytest
import torch

from conftest import assert_same

pytestmark = pytest.mark.usefixtures("any_mode")  # every test, in strict and adaptive eager


def test_single_tensor_list_results():
    x = torch.randn(5, 5)
    assert_same(list(x.to("neuron").unsafe_split(5, 1)), list(x.unsafe_split(5, 1)))
    assert_same(torch._foreach_add([x.to("neuron")], 1.0), torch._foreach_add([x], 1.0))


def test_foreach_adam_on_a_single_parameter():
    def run(device):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, device=device))
        opt = torch.optim.Adam([p], lr=0.1, foreach=True)
        for _ in range(3):
            opt.zero_grad()
            (p * p).sum().backward()
            opt.step()
        return p.detach()

    assert_same(run("neuron"), run("cpu"))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_modes(mode):
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 5, mode=mode)
    indices, offsets = torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 3])
    expected = bag(indices, offsets)
    result = bag.to("neuron")(indices.to("neuron"), offsets.to("neuron"))
    assert_same(result, expected.detach())


def test_batch_norm_functional_in_eval_and_training():
    x, rm, rv = torch.randn(3, 2, 4), torch.zeros(2), torch.ones(2)
    a = torch.ops.aten
    for training in (False, True):
        cpu = a._native_batch_norm_legit(x, None, None, rm.clone(), rv.clone(), training, 0.1, 1e-5)
        dev = a._native_batch_norm_legit(x.to("neuron"), None, None, rm.to("neuron"), rv.to("neuron"), training, 0.1, 1e-5)
        assert [t.shape for t in dev] == [t.shape for t in cpu]
        assert_same(dev[0], cpu[0])


def test_sparse_tensors_are_refused_clearly():
    x = torch.randn(3, 3)
    with pytest.raises(NotImplementedError, match="sparse_coo tensors are not supported"):
        x.to_sparse().to("neuron")
    with pytest.raises(NotImplementedError, match="not supported on the neuron device"):
        x.to_sparse_csr().to("neuron")


def test_integer_histc_counts_like_cuda():
    # The CPU kernel refuses integer input; CUDA (and so every MoE router in transformers)
    # counts it, returning the input's dtype.
    experts = torch.tensor([[0, 2], [2, 3], [3, 3]])
    result = torch.histc(experts.to("neuron"), bins=4, min=0, max=3)
    assert result.dtype == torch.int64
    assert_same(result, torch.histc(experts.double(), bins=4, min=0, max=3).long())
    floats = torch.randn(50)
    assert_same(torch.histc(floats.to("neuron"), bins=7), torch.histc(floats, bins=7))


def test_views_of_a_reinterpreting_view():
    # rotary embeddings: view_as_real / view_as_complex, then reshaped (llama4, deepseek_v2)
    z = torch.randn(2, 3, 4, dtype=torch.complex64)
    for op in (lambda t: torch.view_as_real(t).flatten(2), lambda t: torch.view_as_real(t)[..., 1].transpose(0, 1),
               lambda t: torch.view_as_complex(torch.view_as_real(t).contiguous()).reshape(6, 4)):
        assert_same(op(z.to("neuron")), op(z))
    x = torch.randn(4, 6)
    assert_same(x.to("neuron").view(torch.int32).view(3, 8), x.view(torch.int32).view(3, 8))
