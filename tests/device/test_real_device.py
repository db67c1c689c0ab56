"""``neuron`` is a real PrivateUse1 device: plain tensors with real storage, and the
PyTorch stack that needs one (FakeTensor, torch.compile, storages, checkpoints,
safetensors, transformers, pinned memory, generators, functorch, parametrizations,
checkpointing, hooks, threads). Every number is compared with CPU PyTorch, in both modes.
"""
import copy
import io
import os
import threading

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.usefixtures("any_mode")


def test_a_neuron_tensor_is_a_plain_tensor_of_the_device():
    t = torch.randn(4, 3).to("neuron")
    assert type(t) is torch.Tensor and t.device == torch.device("neuron", 0) and t.is_neuron
    assert torch._C._has_storage(t)


def test_storage_data_pointers_are_real_and_shared_by_views():
    t = torch.randn(4, 3).to("neuron")
    base = t.untyped_storage().data_ptr()
    assert base != 0 and t.untyped_storage().nbytes() == 48
    row = t[1]
    assert row.untyped_storage().data_ptr() == base and row._base is t
    assert row.data_ptr() - t.data_ptr() == 3 * 4
    other = torch.randn(4, 3).to("neuron")
    assert other.untyped_storage().data_ptr() != base


def test_storages_on_the_device():
    storage = torch.UntypedStorage(8, device="neuron")
    assert storage.device.type == "neuron" and storage.nbytes() == 8
    storage.copy_(torch.UntypedStorage.from_buffer(bytes(range(8)), dtype=torch.uint8))
    assert storage.cpu().tolist() == list(range(8))
    assert torch.tensor([], dtype=torch.uint8, device="neuron").set_(storage).cpu().tolist() == list(range(8))
    storage.resize_(12)
    assert storage.nbytes() == 12 and storage.cpu().tolist()[:8] == list(range(8))
    clone = torch.randn(3).to("neuron").untyped_storage().clone()
    assert clone.device.type == "neuron" and clone.nbytes() == 12


@pytest.mark.parametrize("location", ["neuron", "neuron:0", torch.device("neuron"), {"cpu": "neuron"}],
                         ids=["str", "str_index", "device", "dict"])
def test_torch_load_map_location_of_cpu_and_neuron_checkpoints(location):
    cpu = torch.arange(6.0).reshape(2, 3)
    for saved in (cpu, cpu.to("neuron")):
        buffer = io.BytesIO()
        torch.save({"t": saved, "state": nn.Linear(3, 2).state_dict()}, buffer)  # the state stays a CPU one
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=location)
        assert loaded["t"].device.type == "neuron" and loaded["t"].cpu().tolist() == cpu.tolist()
        assert all(v.device.type == "neuron" for v in loaded["state"].values())


def test_a_neuron_checkpoint_loads_on_the_cpu_and_back():
    t = torch.arange(6.0).to("neuron") * 2
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    assert torch.load(buffer, map_location="cpu").tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    buffer.seek(0)
    assert torch.load(buffer).device.type == "neuron"


def test_safetensors_save_file_and_load_file(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    t = torch.randn(4, 3)
    safetensors.save_file({"a": t.to("neuron"), "b": (t[1:] * 2).to("neuron")}, str(tmp_path / "m.safetensors"))
    back = safetensors.load_file(str(tmp_path / "m.safetensors"), device=0)  # the device parser takes an index
    assert back["a"].device.type == "neuron"
    torch.testing.assert_close(back["a"].cpu(), t)
    torch.testing.assert_close(back["b"].cpu(), t[1:] * 2)


def test_transformers_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model.to("neuron").save_pretrained(tmp_path)  # the tied-weight check reads storage pointers
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).to("neuron").eval()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value.cpu(), expected[name]), name
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids.to("neuron")).logits.cpu(), model.cpu()(ids).logits)


def test_fake_tensors_of_neuron_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = torch.randn(4, 3).to("neuron")
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(t)
        assert fake.device.type == "neuron" and fake.shape == (4, 3)
        out = (fake @ fake.t()).relu().sum(0)
        assert out.shape == (4,) and out.device.type == "neuron"
        assert fake.t().contiguous().stride() == (4, 1) and fake[None].expand(2, 4, 3).shape == (2, 4, 3)


def test_torch_compile_aot_eager_forward_and_backward_with_neuron_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    model.to("neuron")
    compiled = torch.compile(lambda x: model(x).pow(2).sum(), backend="aot_eager")
    x = torch.randn(5, 3)
    loss = compiled(x.to("neuron"))
    loss.backward()
    expected = reference(x).pow(2).sum()
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad)


def test_pinned_memory_in_cpu_only_code_and_a_dataloader_feeding_the_device():
    from torch.utils.data import DataLoader, TensorDataset

    assert torch.randn(3).pin_memory().is_pinned() and not torch.randn(3).is_pinned()
    data = torch.arange(16.0).reshape(8, 2)
    loader = DataLoader(TensorDataset(data), batch_size=4, pin_memory=True)
    batches = []
    for (batch,) in loader:
        assert batch.is_pinned()
        batches.append((batch.to("neuron", non_blocking=True) * 2).cpu())
    torch.testing.assert_close(torch.cat(batches), data * 2)


def test_a_neuron_generator_draws_what_a_cpu_generator_with_the_same_seed_draws():
    g, c = torch.Generator(device="neuron"), torch.Generator()
    assert g.device.type == "neuron" and g.initial_seed() == c.initial_seed()
    g.manual_seed(7), c.manual_seed(7)
    draws = [torch.randn(5, device="neuron", generator=g), torch.rand(3, device="neuron", generator=g),
             torch.randint(0, 9, (4,), device="neuron", generator=g)]
    expected = [torch.randn(5, generator=c), torch.rand(3, generator=c), torch.randint(0, 9, (4,), generator=c)]
    for a, b in zip(draws, expected):
        assert torch.equal(a.cpu(), b)
    state = g.get_state()  # waits for the draws queued with it
    first = torch.rand(2, device="neuron", generator=g).cpu()
    g.set_state(state)
    assert torch.equal(torch.rand(2, device="neuron", generator=g).cpu(), first)


def test_host_tensors_drawing_from_a_neuron_generator():
    """``torch.randn(shape, generator=torch.Generator("neuron"))`` on the host (what
    Diffusers' ``randn_tensor`` issues for a neuron pipeline): it draws from the neuron
    generator's stream, in program order with the device's own draws from it, what a CPU
    generator with the same seed draws, and stays on the host. Mixing devices is refused."""
    g, c = torch.Generator("neuron").manual_seed(11), torch.Generator().manual_seed(11)
    drawn = [torch.randn(2, 3, generator=g),                         # host, a factory
             torch.rand(4, device="neuron", generator=g) * 2,         # device, queued
             torch.empty(5).normal_(generator=g),                     # host, in place
             torch.randperm(6, generator=g)]                          # host, integers
    expected = [torch.randn(2, 3, generator=c), torch.rand(4, generator=c) * 2,
                torch.empty(5).normal_(generator=c), torch.randperm(6, generator=c)]
    assert [t.device.type for t in drawn] == ["cpu", "neuron", "cpu", "cpu"]
    for a, b in zip(drawn, expected):
        assert torch.equal(a.cpu(), b)
    with pytest.raises(RuntimeError, match="more than one device|same device"):
        torch.normal(torch.zeros(3), torch.ones(3, device="neuron"), generator=g)


def test_module_to_keeps_parameter_identity_and_tied_weights():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    parameter = model[0].weight
    model.to("neuron")
    assert model[0].weight is parameter and model[1].weight is model[0].weight
    assert parameter.device.type == "neuron" and isinstance(parameter, nn.Parameter)


def test_functorch_vmap_of_grad():
    from torch.func import grad, vmap

    x = torch.randn(5, 3)
    f = vmap(grad(lambda v: (v.sin() * v).sum()))
    torch.testing.assert_close(f(x.to("neuron")).cpu(), f(x))


def test_weight_norm_parametrization_trains_as_on_the_cpu():
    torch.manual_seed(0)
    model = nn.utils.parametrizations.weight_norm(nn.Linear(3, 2))
    reference = copy.deepcopy(model)
    model.to("neuron")
    x = torch.randn(4, 3)
    model(x.to("neuron")).sum().backward()
    reference(x).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), dict(reference.named_parameters())[name].grad)


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    reference = copy.deepcopy(layer)
    layer.to("neuron")
    x = torch.randn(2, 3)
    for module, device in ((layer, "neuron"), (reference, "cpu")):
        inputs = x.to(device).requires_grad_()
        checkpoint(lambda t: module(t).relu().sum(), inputs, use_reentrant=False).backward()
        module.input_grad = inputs.grad.cpu()
    torch.testing.assert_close(layer.input_grad, reference.input_grad)
    torch.testing.assert_close(layer.weight.grad.cpu(), reference.weight.grad)


def test_tensor_and_module_hooks():
    x = torch.randn(3).to("neuron").requires_grad_()
    seen = []
    x.register_hook(lambda g: seen.append(g.cpu()) or g * 2)
    (x * 3).sum().backward()
    assert seen[0].tolist() == [3.0] * 3 and x.grad.cpu().tolist() == [6.0] * 3
    layer = nn.Linear(3, 2).to("neuron")
    outputs = []
    layer.register_forward_hook(lambda module, inputs, output: outputs.append(output.shape))
    layer(torch.randn(4, 3).to("neuron"))
    assert outputs == [torch.Size([4, 2])]


def test_inference_mode():
    t = torch.randn(4, 3)
    with torch.inference_mode():
        y = t.to("neuron").t().contiguous() * 2
    assert y.stride() == (4, 1)
    torch.testing.assert_close(y.cpu(), t.t() * 2)


def test_threads_sharing_the_device():
    results = {}

    def work(i):
        t = torch.full((100,), float(i), device="neuron")
        for _ in range(50):
            t = t + 1
        results[i] = t.sum().item()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {i: 100.0 * (i + 50) for i in range(3)}


def test_views_run_in_cpp_and_equal_the_cpu(monkeypatch):
    """``view``, ``as_strided`` and ``_reshape_alias`` (which ``t``, ``transpose``,
    ``split``, ``narrow`` and ``expand`` reach) are made by C++ kernels
    (device/csrc/views.cpp) and never enter Python; each still counts in ``view_ops``;
    their values and errors are the CPU's."""
    import adaptive_eager
    from adaptive_eager_device.ops import dispatch

    python_views = []
    run_view = dispatch.run_view
    monkeypatch.setattr(dispatch, "run_view", lambda entry, args, kwargs: python_views.append(entry.name)
                        or run_view(entry, args, kwargs))
    host = torch.randn(4, 6)
    t = host.to("neuron")
    adaptive_eager.reset_stats()
    made = [t.view(6, 4), t.t(), t.transpose(0, 1), *t.split(2, dim=1), t.narrow(1, 1, 3), t[1:, ::2],
            t[:, :1].expand(4, 5), t.as_strided((3, 2), (2, 1), 1), t.reshape(24)]
    expected = [host.view(6, 4), host.t(), host.transpose(0, 1), *host.split(2, dim=1), host.narrow(1, 1, 3),
                host[1:, ::2], host[:, :1].expand(4, 5), host.as_strided((3, 2), (2, 1), 1), host.reshape(24)]
    assert python_views == []
    assert adaptive_eager.stats()["view_ops"] >= len(made)
    for got, want in zip(made, expected):
        assert got._base is t and got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
        assert torch.equal(got.cpu(), want)
    with pytest.raises(RuntimeError) as on_cpu:
        host.t().view(24)
    with pytest.raises(RuntimeError) as on_neuron:
        t.t().view(24)
    assert str(on_neuron.value) == str(on_cpu.value)
    with pytest.raises(RuntimeError) as on_cpu:
        host.as_strided((5, 5), (5, 1))
    with pytest.raises(RuntimeError) as on_neuron:
        t.as_strided((5, 5), (5, 1))
    assert str(on_neuron.value) == str(on_cpu.value)
