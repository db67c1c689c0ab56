"""Tensor semantics on `neuron` equal CPU PyTorch: views, in-place, autograd attributes,
printing, copies, dtypes, devices, serialization."""
import copy
import io
import warnings

import pytest
import torch

from conftest import assert_same

pytestmark = pytest.mark.usefixtures("any_mode")  # every test, in strict and adaptive eager


def both(cpu_tensor):
    return cpu_tensor.clone(), cpu_tensor.to("neuron")


# -- factories ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        lambda d: torch.empty(2, 3, device=d).fill_(1.5),
        lambda d: torch.zeros(2, 3, device=d),
        lambda d: torch.ones(4, dtype=torch.int32, device=d),
        lambda d: torch.full((2, 2), 7.0, device=d),
        lambda d: torch.arange(10, device=d),
        lambda d: torch.arange(0.0, 1.0, 0.125, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.linspace(0, 1, 7, device=d),
        lambda d: torch.logspace(0, 2, 5, device=d),
        lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        lambda d: torch.tensor(3.5, device=d),
        lambda d: torch.zeros_like(torch.ones(2, 2), device=d),
        lambda d: torch.full_like(torch.ones(3), 2.0, device=d),
        lambda d: torch.ones(2, 3, dtype=torch.bfloat16, device=d),
        lambda d: torch.tril(torch.ones(3, 3, device=d)),
        lambda d: torch.scalar_tensor(2.0, device=d),
    ],
)
def test_factories(factory):
    assert_same(factory("neuron"), factory("cpu"))


@pytest.mark.parametrize(
    "factory",
    [
        lambda d: torch.rand(3, 4, device=d),
        lambda d: torch.randn(5, device=d),
        lambda d: torch.randint(0, 10, (6,), device=d),
        lambda d: torch.randperm(8, device=d),
        lambda d: torch.rand_like(torch.ones(3), device=d),
        lambda d: torch.randn_like(torch.ones(3), device=d),
        lambda d: torch.empty(4, device=d).uniform_(-1, 1),
        lambda d: torch.empty(4, device=d).normal_(2, 3),
    ],
)
def test_random_factories_match_cpu_with_the_same_seed(factory):
    torch.manual_seed(123)
    expected = factory("cpu")
    torch.manual_seed(123)
    assert_same(factory("neuron"), expected)


def test_device_generator_ignores_host_draws():
    torch.manual_seed(7)
    expected = torch.rand(5)
    torch.manual_seed(7)
    torch.randn(100)  # the host draws from the CPU generator meanwhile
    assert_same(torch.rand(5, device="neuron"), expected)


def test_rng_state_roundtrip():
    torch.manual_seed(3)
    state = torch.neuron.get_rng_state()
    first = torch.rand(4, device="neuron").cpu()
    torch.neuron.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="neuron").cpu(), first)
    torch.neuron.manual_seed(3)
    assert torch.equal(torch.rand(4, device="neuron").cpu(), first)


# -- views --------------------------------------------------------------------------

VIEWS = {
    "view": lambda t: t.view(4, 6),
    "reshape": lambda t: t.reshape(2, 12),
    "slice": lambda t: t[1:, ::2],
    "t": lambda t: t.t(),
    "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.view(2, 3, 4).permute(2, 0, 1),
    "expand": lambda t: t[:1].expand(5, 6),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "as_strided": lambda t: t.as_strided((3, 3), (2, 1), 1),
    "narrow": lambda t: t.narrow(1, 2, 3),
    "select": lambda t: t.select(0, 2),
    "diagonal": lambda t: t.diagonal(),
    "unfold": lambda t: t.unfold(1, 2, 2),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_alias_their_base(name):
    make = VIEWS[name]
    cpu, dev = both(torch.arange(24.0).view(4, 6))
    cpu_view, dev_view = make(cpu), make(dev)
    assert dev_view.shape == cpu_view.shape
    assert dev_view.stride() == cpu_view.stride()
    assert dev_view.storage_offset() == cpu_view.storage_offset()
    assert dev_view.is_contiguous() == cpu_view.is_contiguous()
    assert dev_view._base is dev or dev_view._base is not None
    # in-place on the view updates the base, and the reverse
    if name != "expand":
        cpu_view.mul_(-1)
        dev_view.mul_(-1)
        assert_same(dev, cpu)
    cpu.add_(100)
    dev.add_(100)
    assert_same(dev_view, cpu_view)


@pytest.mark.parametrize("split", ["unbind", "split", "chunk"])
def test_multi_output_views(split):
    cpu, dev = both(torch.arange(12.0).view(3, 4))
    pieces = {"unbind": lambda t: t.unbind(0), "split": lambda t: t.split(2, 1), "chunk": lambda t: t.chunk(3, 0)}[split]
    for a, b in zip(pieces(cpu), pieces(dev)):
        a.add_(1)
        b.add_(1)
    assert_same(dev, cpu)


def test_view_of_pending_result_sees_the_kernel_output():
    x = torch.randn(8, 8)
    dev = (x.to("neuron") * 3 + 1)  # the producer may still be queued
    view = dev[2:5].t()
    assert_same(view, (x * 3 + 1)[2:5].t())


def test_inplace_metadata_ops():
    for op in [lambda t: t.t_(), lambda t: t.unsqueeze_(0), lambda t: t.squeeze_(), lambda t: t.transpose_(0, 1)]:
        cpu, dev = both(torch.arange(6.0).view(2, 3))
        op(cpu)
        op(dev)
        assert dev.shape == cpu.shape and dev.stride() == cpu.stride()
        assert_same(dev * 2, cpu * 2)


def test_resize_and_out_argument():
    out = torch.empty(0, device="neuron")
    torch.add(torch.ones(3, device="neuron"), 2, out=out)
    assert_same(out, torch.full((3,), 3.0))
    r = torch.zeros(2, device="neuron")
    r.resize_(4)
    assert r.shape == (4,)


def _resize_warnings(device, call, times=2):
    """The warnings of ``call`` run ``times`` times: (file name, line, message) each, the
    message without the CPU's "(Triggered internally at ...)" note."""
    seen = []
    for _ in range(times):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(device)
            torch.neuron.synchronize()
        seen += [(w.filename, str(w.message).split(" (Triggered internally")[0]) for w in caught]
    return seen


def _cat_into_its_own_input(x):  # the out= tensor shares the inputs' storage: the overlap trial runs
    torch.cat([x[:1], x[:1]], out=x[1:].reshape(9)[:3])


@pytest.mark.parametrize("call", [
    lambda d: torch.cat([torch.ones(2, 3, device=d)] * 2, out=torch.empty(2, device=d)),
    lambda d: torch.add(torch.ones(3, device=d), 1, out=torch.empty(2, 2, device=d)),
    lambda d: torch.sort(torch.ones(4, 3, device=d), out=(torch.empty(2, device=d),
                                                          torch.empty(2, dtype=torch.long, device=d))),
    lambda d: _cat_into_its_own_input(torch.ones(4, 3, device=d)),
    lambda d: torch.mul(torch.ones(2, device=d), 3, out=torch.empty(0, device=d)),
], ids=["cat", "add", "sort_two_outputs", "cat_into_a_view_of_its_input_storage", "empty_out_no_warning"])
def test_an_out_tensor_resized_warns_once_per_call_at_the_users_line_as_on_the_cpu(call):
    expected = _resize_warnings("cpu", call)
    assert _resize_warnings("neuron", call) == expected
    assert all(filename == __file__ for filename, _ in expected) and len(expected) in (0, 2, 4)


# -- autograd attributes ------------------------------------------------------------


def test_data_detach_requires_grad_grad_and_hooks():
    w = torch.randn(3, requires_grad=True)
    dw = w.detach().to("neuron").requires_grad_()
    seen = []
    dw.register_hook(lambda g: seen.append(g.cpu()) or g * 2)
    (dw * dw).sum().backward()
    (w * w).register_hook(lambda g: g)
    expected = 2 * (2 * w.detach())
    assert_same(dw.grad, expected)
    assert len(seen) == 1
    assert dw.data.requires_grad is False and dw.detach().requires_grad is False
    dw.data.zero_()
    assert_same(dw.detach(), torch.zeros(3))
    assert dw.grad.device.type == "neuron"


def test_grad_accumulates_and_set_to_none():
    lin = torch.nn.Linear(3, 2).to("neuron")
    x = torch.randn(4, 3, device="neuron")
    lin(x).sum().backward()
    first = lin.weight.grad.clone()
    lin(x).sum().backward()
    assert_same(lin.weight.grad, (first * 2).cpu())
    torch.optim.SGD(lin.parameters(), lr=0.1).zero_grad(set_to_none=True)
    assert lin.weight.grad is None


# -- printing -----------------------------------------------------------------------


def test_repr_looks_like_cuda():
    t = torch.tensor([1.0, 2.5], device="neuron")
    assert repr(t) == "tensor([1.0000, 2.5000], device='neuron:0')"
    assert str(torch.tensor([1, 2], device="neuron")) == "tensor([1, 2], device='neuron:0')"
    h = torch.tensor([1.0], dtype=torch.float16, device="neuron")
    assert repr(h) == "tensor([1.], device='neuron:0', dtype=torch.float16)"
    g = torch.ones(2, device="neuron", requires_grad=True)
    assert repr(g) == "tensor([1., 1.], device='neuron:0', requires_grad=True)"
    assert repr(g * 2) == "tensor([2., 2.], device='neuron:0', grad_fn=<MulBackward0>)"
    assert repr(torch.empty(0, 3, device="neuron")) == "tensor([], device='neuron:0', size=(0, 3))"
    p = torch.nn.Parameter(torch.zeros(1, device="neuron"))
    assert repr(p) == "Parameter containing:\ntensor([0.], device='neuron:0', requires_grad=True)"
    assert f"{torch.tensor(0.5, device='neuron'):.3f}" == "0.500"


# -- copies, dtypes, devices --------------------------------------------------------


def test_copy_across_devices_and_dtypes():
    src = torch.randn(3, 4)
    dev = torch.zeros(3, 4, device="neuron")
    dev.copy_(src)
    assert_same(dev, src)
    host = torch.empty(3, 4)
    host.copy_(dev * 2)
    torch.testing.assert_close(host, src * 2)
    half = torch.zeros(3, 4, dtype=torch.float16, device="neuron")
    half.copy_(dev)
    assert_same(half, src.half())
    assert_same(dev.to(torch.bfloat16), src.to(torch.bfloat16))
    assert_same(dev.int(), src.int())
    assert_same(dev.double(), src.double())


def test_host_source_is_snapshotted_at_issue_time():
    src = torch.ones(4)
    dev = src.to("neuron")
    src.mul_(5)  # the host changes its tensor before the device reads it
    assert_same(dev, torch.ones(4))


def test_non_contiguous_inputs():
    cpu = torch.randn(6, 5)
    dev = cpu.to("neuron")
    assert_same(dev.t() @ dev, cpu.t() @ cpu)
    assert_same(dev[:, ::2].exp(), cpu[:, ::2].exp())
    assert_same(dev.t().contiguous(), cpu.t().contiguous())


def test_zero_dim_tensors():
    cpu, dev = both(torch.tensor(2.5))
    assert_same(dev * 3, cpu * 3)
    assert (dev + 1).item() == 3.5
    assert bool(dev > 1)
    assert float(dev) == 2.5 and int(dev) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool])
def test_dtypes(dtype):
    cpu = (torch.arange(12).view(3, 4) % 5).to(dtype)
    dev = cpu.to("neuron")
    assert dev.dtype == dtype
    assert_same(dev, cpu)
    if dtype is torch.bool:
        assert_same(dev & dev.logical_not(), cpu & cpu.logical_not())
    else:
        assert_same(dev + dev, cpu + cpu)
        assert_same(dev.sum(0), cpu.sum(0))


def test_cpu_scalar_tensor_mixes_like_cuda():
    dev = torch.ones(3, device="neuron")
    assert_same(dev * torch.tensor(2.0), torch.full((3,), 2.0))
    assert_same(torch.tensor(2.0) + dev, torch.full((3,), 3.0))


def test_cpu_tensor_of_higher_rank_is_rejected():
    dev = torch.ones(3, device="neuron")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dev + torch.ones(3)


def test_cpu_indices_are_accepted_for_indexing():
    cpu = torch.arange(10.0)
    dev = cpu.to("neuron")
    index = torch.tensor([1, 3, 5])
    assert_same(dev[index], cpu[index])
    dev[index] = 0.0
    cpu[index] = 0.0
    assert_same(dev, cpu)


def test_host_errors_raise_immediately():
    a = torch.ones(2, 3, device="neuron")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        a @ a
    with pytest.raises(RuntimeError, match="must match the size"):
        a + torch.ones(4, device="neuron")


# -- serialization and copies -------------------------------------------------------


def test_save_load_tensors_and_state_dicts():
    model = torch.nn.Linear(3, 2).to("neuron")
    buffer = io.BytesIO()
    torch.save({"state": model.state_dict(), "t": torch.arange(3, device="neuron")}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["t"].device.type == "neuron"
    assert_same(loaded["t"], torch.arange(3))
    for name, value in model.state_dict().items():
        assert loaded["state"][name].device.type == "neuron"
        assert_same(loaded["state"][name], value.cpu())
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu"
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(on_cpu["state"])
    torch.testing.assert_close(fresh.weight, model.weight.detach().cpu())


def test_deepcopy_of_a_model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).to("neuron")
    clone = copy.deepcopy(model)
    assert isinstance(clone[0].weight, torch.nn.Parameter)
    assert clone[0].weight.device.type == "neuron"
    with torch.no_grad():
        clone[0].weight.add_(1)
    assert not torch.equal(clone[0].weight.cpu(), model[0].weight.cpu())


def test_numpy_and_tolist_need_a_host_copy():
    dev = torch.arange(4, device="neuron")
    assert dev.tolist() == [0, 1, 2, 3]
    assert dev.cpu().numpy().tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="neuron"):
        dev.numpy()


def test_module_to_keeps_tied_weights_tied():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    cpu = Tied()
    dev = Tied()
    dev.load_state_dict(cpu.state_dict())
    dev.to("neuron")
    assert dev.embed.weight is dev.head.weight
    assert isinstance(dev.embed.weight, torch.nn.Parameter) and dev.embed.weight.device.type == "neuron"
    tokens = torch.tensor([1, 2, 7])
    cpu.head(cpu.embed(tokens)).sum().backward()
    dev.head(dev.embed(tokens.to("neuron"))).sum().backward()
    assert_same(dev.embed.weight.grad, cpu.embed.weight.grad)  # both uses accumulate into one grad


def test_an_empty_like_calls_layout_is_the_meta_devices_for_each_distinct_call():
    """``recorder.allocate`` runs an empty-like op on the meta device once per distinct call
    (its sizes, a tensor argument's layout, dtype and memory format, the default dtype) and
    reuses that layout: each call below gets the layout the CPU gives it."""
    from adaptive_eager_device.ops import recorder

    base = torch.randn(3, 5)
    calls = [
        lambda d, b: torch.empty(2, 3, device=d),
        lambda d, b: torch.empty((2, 3), dtype=torch.int16, device=d),
        lambda d, b: torch.empty(1, 3, 4, 5, memory_format=torch.channels_last, device=d),
        lambda d, b: torch.empty_like(b.t()),
        lambda d, b: torch.empty_like(b),
        lambda d, b: torch.empty_like(b.t(), memory_format=torch.contiguous_format),
        lambda d, b: b.new_empty((4, 2), dtype=torch.float64),
        lambda d, b: torch.empty_strided((2, 3), (1, 2), device=d),
    ]
    for default in (torch.float32, torch.float64, torch.float32):
        torch.set_default_dtype(default)
        try:
            for call in calls:
                got, want = call("neuron", base.to("neuron")), call("cpu", base)
                assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        finally:
            torch.set_default_dtype(torch.float32)
    size = len(recorder._LAYOUTS)
    for call in calls:
        call("neuron", base.to("neuron"))
    assert len(recorder._LAYOUTS) == size  # each met before: no new meta run
