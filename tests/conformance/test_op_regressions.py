"""Ops that once went wrong on `neuron`, each checked against the CPU."""
import contextlib
import warnings

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


def test_compressed_sparse_tensors_are_refused_clearly():
    # COO tensors are the device's (tests/device/test_sparse.py); CSR and the other compressed
    # layouts are refused at the call.
    x = torch.randn(3, 3)
    with pytest.raises(NotImplementedError, match="not supported on the neuron device"):
        x.to_sparse_csr().to("neuron")
    with pytest.raises(NotImplementedError, match="not supported on the neuron device"):
        torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1.0]), device="neuron")


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


# -- found by the OpInfo sweep in bfloat16 and backward (bench/op_coverage.py) -------------
def _grads(fn, inputs, device):
    """Gradients of ``fn`` on ``device`` with a fixed cotangent, as CPU tensors."""
    torch.manual_seed(0)
    leaves = [t.detach().to(device).requires_grad_(t.is_floating_point() or t.is_complex()) for t in inputs]
    out = fn(*leaves)
    cotangent = torch.randn(out.shape, dtype=out.dtype).to(device)
    grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], cotangent)
    return out.detach(), [g for g in grads]


def _assert_same_grads(fn, *inputs, **tolerances):
    cpu_out, cpu_grads = _grads(fn, inputs, "cpu")
    out, grads = _grads(fn, inputs, "neuron")
    assert_same(out, cpu_out, **tolerances)
    assert_same(grads, cpu_grads, **tolerances)


def test_conjugate_views_carry_the_conjugate_bit():
    # A neuron tensor viewed with conj() must say is_conj(), as a CPU or CUDA tensor does:
    # real()/imag() and resolve_conj() read the bit. Without it, torch.fft.hfft's backward
    # (real() of a conjugate) aborted the process in the autograd thread.
    z = torch.randn(2, 3, dtype=torch.complex64)
    c = z.to("neuron").conj()
    assert c.is_conj() and z.conj().is_conj()
    for op in (torch.real, torch.imag, lambda t: t.resolve_conj(), lambda t: torch.view_as_real(t.resolve_conj()),
               lambda t: t + 1, lambda t: t.t().contiguous(), lambda t: t @ t.t(), lambda t: t.conj() * 2):
        assert_same(op(c), op(z.conj()).resolve_conj())
    n = torch._neg_view(z.to("neuron"))
    assert n.is_neg()
    assert_same(n.resolve_neg(), torch._neg_view(z).resolve_neg())
    x = torch.randn(5, 6, 7)
    _assert_same_grads(lambda t: torch.fft.hfft(t, n=10, dim=1, norm="ortho"), x)
    _assert_same_grads(lambda t: torch.real(torch.fft.fft(t).conj()), torch.randn(8))


def test_arange_with_float_bounds_of_new_values():
    # torch.arange fills an empty tensor through arange.out: the float bounds decide the
    # out tensor's size, so they are part of the shape-inference key (mvlgamma's backward
    # builds arange(-p / 2 + 0.5, 0.5, 0.5) for each p).
    for start in (0.0, -1.0, -2.0, -1.5):
        assert_same(torch.arange(start, 0.5, 0.5, device="neuron"), torch.arange(start, 0.5, 0.5))
    for steps_end in (1.0, 3.0, 2.5):
        out = torch.empty(0, device="neuron")
        assert_same(torch.arange(0.0, steps_end, 0.5, out=out), torch.arange(0.0, steps_end, 0.5))
    x = torch.rand(4, 5) + 3
    for p in (1, 3, 5):
        _assert_same_grads(lambda t: torch.mvlgamma(t, p), x)


def test_bfloat16_norm_statistics_have_the_cpu_dtype():
    # The CPU returns layer norm's mean/rstd and batch norm's saved statistics in
    # bfloat16 for bfloat16 input; the meta kernels say float32 (CUDA's choice).
    a = torch.ops.aten
    x = torch.randn(4, 3, 5, dtype=torch.bfloat16)
    w, b = torch.randn(5, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16)
    cpu = a.native_layer_norm.default(x, [5], w, b, 1e-5)
    dev = a.native_layer_norm.default(x.to("neuron"), [5], w.to("neuron"), b.to("neuron"), 1e-5)
    assert_same(list(dev), list(cpu))
    c = torch.randn(3, dtype=torch.bfloat16)
    for op in (a._batch_norm_with_update.default, a._batch_norm_with_update_functional.default):
        stats = (torch.zeros(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))
        cpu = op(x, c, c, *[s.clone() for s in stats], 0.1, 1e-5)
        dev = op(x.to("neuron"), c.to("neuron"), c.to("neuron"), *[s.to("neuron") for s in stats], 0.1, 1e-5)
        assert [t.dtype for t in dev] == [t.dtype for t in cpu]
        assert_same([t for t in dev if t.numel()], [t for t in cpu if t.numel()])
    cpu = a._batch_norm_no_update.default(x, c, c, torch.zeros(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16), 0.1, 1e-5)
    dev = a._batch_norm_no_update.default(x.to("neuron"), c.to("neuron"), c.to("neuron"),
                                          torch.zeros(3, dtype=torch.bfloat16).to("neuron"),
                                          torch.ones(3, dtype=torch.bfloat16).to("neuron"), 0.1, 1e-5)
    assert [t.dtype for t in dev] == [t.dtype for t in cpu]
    ln = torch.nn.LayerNorm(5).to(torch.bfloat16)
    _assert_same_grads(lambda t, w, b: torch.nn.functional.layer_norm(t, (5,), w, b), x, ln.weight, ln.bias)


def test_a_kernel_result_of_another_dtype_is_an_error_not_a_conversion():
    from adaptive_eager_device.memory.storage import DeviceStorage

    storage = DeviceStorage((3,), (1,), torch.float32, 12)
    storage.materialize()
    with pytest.raises(RuntimeError, match="shape inference predicted"):
        storage.adopt(torch.zeros(3, dtype=torch.bfloat16))


def test_backward_kernels_without_meta_kernels_stay_on_the_device():
    # No meta kernel in PyTorch: once they ran on the CPU fallback, a sync point in every
    # training step. Their output metadata comes from a CPU probe now.
    import adaptive_eager
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(4, 5)
    adaptive_eager.reset_stats()
    _assert_same_grads(lambda t: F.multi_margin_loss(t, torch.tensor([0, 4, 2, 1]).to(t.device)), x)
    _assert_same_grads(lambda t: F.multilabel_margin_loss(t, torch.tensor([[0, 4, -1, 0, 0]] * 4).to(t.device)), x)
    samples = torch.rand(1, 2, 3)
    _assert_same_grads(lambda t: F.fractional_max_pool3d(t, 2, output_size=(2, 2, 2), _random_samples=samples.to(t.device)),
                       torch.randn(1, 2, 4, 4, 4))
    log_probs = torch.randn(6, 2, 4).log_softmax(-1)
    targets = torch.tensor([[1, 2, 3], [3, 1, 1]])
    _assert_same_grads(lambda t: F.ctc_loss(t, targets.to(t.device), [6, 5], [3, 2], reduction="none"), log_probs)
    _assert_same_grads(lambda t: F.ctc_loss(t, targets.to(t.device), torch.tensor([6, 5]).to(t.device),
                                            torch.tensor([3, 2]).to(t.device)), log_probs)
    assert adaptive_eager.stats()["fallback_ops"] == {}


def test_histograms_stay_on_the_device():
    import adaptive_eager

    adaptive_eager.reset_stats()
    x, w = torch.randn(20), torch.rand(20)
    assert_same(list(torch.histogram(x.to("neuron"), 5, weight=w.to("neuron"))), list(torch.histogram(x, 5, weight=w)))
    edges = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0])
    assert_same(list(torch.histogram(x.to("neuron"), edges.to("neuron"))), list(torch.histogram(x, edges)))
    pts = torch.randn(30, 2)
    got, want = torch.histogramdd(pts.to("neuron"), bins=[3, 4]), torch.histogramdd(pts, bins=[3, 4])
    assert_same(got.hist, want.hist)
    assert_same(list(got.bin_edges), list(want.bin_edges))
    bins = [torch.tensor([-3.0, 0.0, 3.0]), torch.tensor([-1.0, 0.0, 0.5, 2.0])]
    got, want = torch.histogramdd(pts.to("neuron"), bins=[b.to("neuron") for b in bins]), torch.histogramdd(pts, bins=bins)
    assert_same(got.hist, want.hist)
    assert adaptive_eager.stats()["fallback_ops"] == {}
    with pytest.raises(RuntimeError):  # the CPU's argument checks still apply at once
        torch.histogram(x.to("neuron"), 5, weight=torch.rand(3).to("neuron"))


def test_grouped_mm_in_float32_runs_on_the_device():
    # transformers' MoE experts: the meta kernel takes only bfloat16 (CUDA's), the CPU float32
    import adaptive_eager

    a, b = torch.randn(6, 8), torch.randn(3, 8, 16)
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    adaptive_eager.reset_stats()
    result = torch._grouped_mm(a.to("neuron"), b.to("neuron"), offs=offs.to("neuron"))
    assert_same(result, torch._grouped_mm(a, b, offs=offs))
    assert adaptive_eager.stats()["fallback_ops"] == {}


# -- bfloat16: the kernel the CPU runs, not a composite that rounds at each step ----------
EXACT = {"rtol": 0, "atol": 0}


@pytest.mark.parametrize("activation", ["silu", "mish"])
def test_bfloat16_activation_gradients_are_the_cpus_kernels(activation):
    # silu_backward and mish_backward are composites for PrivateUse1; the CPU's kernels
    # compute a bfloat16 gradient in float32, the composite rounds each of its ops.
    function = getattr(torch.nn.functional, activation)
    torch.manual_seed(0)
    x, grad = torch.randn(4096, dtype=torch.bfloat16), torch.randn(4096, dtype=torch.bfloat16)
    expected, = torch.autograd.grad(function(x.requires_grad_()), x, grad)
    on_device = x.detach().to("neuron").requires_grad_()
    result, = torch.autograd.grad(function(on_device), on_device, grad.to("neuron"))
    assert_same(result, expected, **EXACT)


@pytest.mark.parametrize("masking", ["none", "causal", "boolean"])
def test_bfloat16_attention_runs_the_kernel_the_cpu_picks(masking):
    # The CPU runs 4-d attention without dropout as its flash kernel (float32
    # accumulation); the composite's math decomposition on the device rounded each step.
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 16, 8, dtype=torch.bfloat16) for _ in range(4))
    mask = torch.rand(16, 16) > 0.3 if masking == "boolean" else None

    def attend(q, k, v, grad):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.device),
                                             is_causal=masking == "causal")
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]

    result = attend(*(t.to("neuron") for t in (q, k, v, grad)))
    assert_same(result, attend(q, k, v, grad), **EXACT)


def test_attention_arguments_the_composite_refuses_raise_its_errors():
    # The flash path skips some of the composite's checks: such calls go to the composite.
    import torch.nn.functional as F

    q = torch.randn(2, 2, 4, 8).to("neuron")
    with pytest.raises(RuntimeError, match="attn_mask dtype to be bool or float"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.int64).to("neuron"))
    with pytest.raises(RuntimeError, match="same device type"):
        F.scaled_dot_product_attention(q, torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8))


def test_attention_with_a_mask_that_requires_grad_takes_the_cpus_math_path():
    # The CPU's flash kernel has no gradient for its mask, so the CPU picks math for a
    # mask that requires grad (a model computing its mask from parameters: transformers'
    # doge); the device must pick the same, and give the mask's gradient.
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 16, 8) for _ in range(4))
    mask = torch.randn(16, 16)

    def attend(q, k, v, mask, grad):
        q, k, v, mask = (t.requires_grad_() for t in (q, k, v, mask))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v, mask), grad)]

    result = attend(*(t.to("neuron") for t in (q, k, v, mask, grad)))
    assert_same(result, attend(q, k, v, mask, grad), **EXACT)


@pytest.mark.parametrize("make", [
    lambda: torch._empty_affine_quantized([2, 2], scale=2, zero_point=3, dtype=torch.quint8, device="neuron"),
    lambda: torch.empty(2, dtype=torch.qint8, device="neuron"),
    lambda: torch.quantize_per_tensor(torch.ones(2, device="neuron"), 0.1, 0, torch.quint8),
    lambda: torch.quantize_per_channel(torch.ones(2, 2, device="neuron"), torch.ones(2, device="neuron"),
                                       torch.zeros(2, dtype=torch.long, device="neuron"), 0, torch.quint8),
    lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8).to("neuron"),
], ids=["empty_affine_quantized", "empty_qint8", "quantize_per_tensor", "quantize_per_channel", "upload"])
def test_quantized_tensors_are_refused_at_the_call(make):
    """Issue 35: PyTorch has no quantized kernels for a PrivateUse1 device; a quantized
    tensor on neuron is refused at the call by name (the dispatcher's message listed
    backends; quantize_per_tensor made a float tensor and a deferred kernel failure)."""
    with _quietly():
        with pytest.raises(NotImplementedError, match="quantized tensors are not supported on the neuron device"):
            make()
    torch.neuron.synchronize()  # nothing deferred


@contextlib.contextmanager
def _quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor's deprecation warning
        yield


def test_unbatched_channels_last_3d_max_pool3d_has_the_cpu_layout():
    """Issue 35 (test_max_pool3d_ndhwc): an unbatched (C, D, H, W) input laid out
    channels-last-3d gives outputs of that layout on the CPU; the meta kernel gave
    contiguous ones."""
    torch.manual_seed(0)
    x = torch.randn(1, 6, 12, 13, 14).contiguous(memory_format=torch.channels_last_3d).squeeze(0)
    grad = torch.randn(1, 6, 2, 2, 2).contiguous(memory_format=torch.channels_last_3d).squeeze(0)

    def run(device):
        t = x.to(device).requires_grad_()
        out, indices = torch.nn.functional.max_pool3d(t, (5, 6, 7), return_indices=True)
        out.backward(grad.to(device))
        return out, indices, t.grad

    for got, expected in zip(run("neuron"), run("cpu")):
        assert got.stride() == expected.stride()
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.int32, torch.uint8, torch.bool])
def test_deterministic_mode_fills_uninitialized_memory_as_the_cpu(dtype):
    """Issue 35 (test_deterministic_empty, test_deterministic_resize): under
    torch.use_deterministic_algorithms(True) ATen fills fresh memory with NaN (floating,
    complex) or the dtype's largest value, at the call; and a storage grown by resize_
    in its new part only. Read after the mode is off, as the upstream tests read."""
    from torch.testing._internal.common_utils import DeterministicGuard

    def made(device):
        with DeterministicGuard(True, fill_uninitialized_memory=True):
            tensors = [torch.empty(10, 9, device=device, dtype=dtype),
                       torch.empty_like(torch.zeros(10, 9, device=device, dtype=dtype)),
                       torch.empty_strided((10, 9), (1, 5), device=device, dtype=dtype),
                       torch.empty_permuted((2, 3, 5), (1, 0, 2), device=device, dtype=dtype)]
            grown = torch.ones(2, 3, device=device, dtype=dtype)
            grown.resize_(4, 5)
            tensors.append(grown)
        return [t.cpu() for t in tensors]

    for got, expected in zip(made("neuron"), made("cpu")):
        assert torch.equal(got.isnan(), expected.isnan()) if dtype.is_floating_point or dtype.is_complex else True
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected)) if dtype.is_complex or dtype.is_floating_point \
            else torch.equal(got, expected)


def test_a_data_dependent_op_refuses_a_host_out_tensor():
    """Issue 35: nonzero (or masked_select) of a neuron tensor into an out= tensor on the
    CPU raises CUDA's device mismatch at the call; it wrote the host tensor. An out= of
    the wrong dtype raises the CPU's error at the call."""
    x = torch.tensor([0.0, 1.0, 2.0], device="neuron")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.nonzero(x, out=torch.empty(0, dtype=torch.long))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.masked_select(x, x > 0, out=torch.empty(0))
    with pytest.raises(RuntimeError, match="Expected out tensor to have scalar type Long"):
        torch.nonzero(x, out=torch.empty(0, device="neuron"))
    out = torch.empty(0, dtype=torch.long, device="neuron")
    torch.nonzero(x, out=out)
    assert torch.equal(out.cpu(), torch.tensor([[1], [2]]))
