"""The pattern library: each hand-written chain runs as one library kernel, gives the CPU's
numbers on the unfused code (within the tolerance fusion/patterns.py documents), and does
not apply when it would not be exactly right."""
import copy
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from conftest import assert_same, on_device, windows_at_sync_points

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.workloads import LlamaRMSNorm, apply_rotary_pos_emb, rotate_half  # noqa: E402  (as Hugging Face writes them)


@pytest.fixture(autouse=True)
def policy(adaptive_mode):
    """One window per test, flushed at the sync point; the on-chip rule off, so the only
    fusion that crosses anchors is the pattern's."""
    yield from windows_at_sync_points(on_chip_bytes=0, patterns=True)


def patterns():
    return adaptive_eager.stats()["patterns"]


def kernel_names():
    return sorted(adaptive_eager.stats()["kernels"])


def softmax_by_hand(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def test_softmax_written_out_is_one_kernel():
    x = torch.randn(8, 32)
    (d,) = on_device(x)
    assert_same(softmax_by_hand(d), softmax_by_hand(x), rtol=1e-6, atol=1e-7)
    assert patterns() == {"softmax": {"matched": 1, "ops": 5}}
    assert kernel_names() == ["softmax(amax|sub|exp|sum|div)"]
    assert adaptive_eager.stats()["kernels_launched"] == 1


def test_log_softmax_written_out_is_one_kernel():
    def by_hand(x):
        shifted = x - x.amax(-1, keepdim=True)
        return shifted - torch.log(torch.exp(shifted).sum(-1, keepdim=True))

    x = torch.randn(4, 16)
    (d,) = on_device(x)
    assert_same(by_hand(d), by_hand(x), rtol=1e-6, atol=1e-6)
    assert patterns() == {"log_softmax": {"matched": 1, "ops": 6}}


def test_gelu_tanh_formula_is_one_kernel():
    def gelu(h):
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))

    x = torch.randn(64)
    (d,) = on_device(x)
    assert_same(gelu(d), gelu(x), rtol=1e-6, atol=1e-6)
    assert patterns() == {"gelu_tanh": {"matched": 1, "ops": 8}}


def test_gelu_erf_formula_is_one_kernel():
    def gelu(h):
        return h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))

    x = torch.randn(64)
    (d,) = on_device(x)
    assert_same(gelu(d), gelu(x), rtol=1e-6, atol=1e-6)
    assert patterns() == {"gelu_erf": {"matched": 1, "ops": 5}}


def test_silu_is_one_kernel():
    x = torch.randn(64)
    (d,) = on_device(x)
    assert_same(d * torch.sigmoid(d), x * torch.sigmoid(x), rtol=1e-6, atol=1e-7)
    assert patterns() == {"silu": {"matched": 1, "ops": 2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_rms_norm_is_one_kernel(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(4, 8, 32).to(dtype)
    device_norm = LlamaRMSNorm(32).to("neuron")
    device_norm.load_state_dict(norm.state_dict())
    (d,) = on_device(x)
    with torch.no_grad():
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype is torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
        assert_same(device_norm(d), norm(x), **tolerance)
    assert patterns()["rms_norm"]["matched"] == 1


def test_rms_norm_of_a_view_is_one_kernel():
    """The query/key norms of Qwen3-style attention normalize a view (the heads split out
    of a projection): each op of the chain records its own reference to the view, which
    the matcher compares by value."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(8)
    norm.weight.data.uniform_(0.5, 1.5)
    device_norm = LlamaRMSNorm(8).to("neuron")
    device_norm.load_state_dict(norm.state_dict())
    x = torch.randn(4, 32)
    (d,) = on_device(x)
    with torch.no_grad():
        assert_same(device_norm(d.view(4, 4, 8)[:, 1:]), norm(x.view(4, 4, 8)[:, 1:]), rtol=1e-5, atol=1e-6)
    assert patterns()["rms_norm"]["matched"] == 1


def test_gelu_and_silu_of_a_view_are_one_kernel_each():
    x = torch.randn(8, 16)
    (d,) = on_device(x)
    half = d[:, :8]
    gelu = 0.5 * half * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (half + 0.044715 * torch.pow(half, 3.0))))
    silu = half * torch.sigmoid(half)
    expected_half = x[:, :8]
    assert_same(gelu, torch.nn.functional.gelu(expected_half, approximate="tanh"), rtol=1e-5, atol=1e-6)
    assert_same(silu, torch.nn.functional.silu(expected_half), rtol=1e-6, atol=1e-7)
    assert {name: counts["matched"] for name, counts in patterns().items()} == {"gelu_tanh": 1, "silu": 1}


def test_layer_norm_written_out_is_one_kernel():
    def by_hand(x, w, b):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + 1e-5) * w + b

    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    dx, dw, db = on_device(x, w, b)
    assert_same(by_hand(dx, dw, db), by_hand(x, w, b), rtol=1e-5, atol=1e-5)
    assert patterns() == {"layer_norm": {"matched": 1, "ops": 8}}
    assert_same(by_hand(dx, dw, db), F.layer_norm(x, (16,), w, b, 1e-5), rtol=1e-5, atol=1e-5)


def test_linear_written_out_becomes_addmm():
    x, w, b = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    dx, dw, db = on_device(x, w, b)
    assert_same(dx @ dw.t() + db, x @ w.t() + b, rtol=1e-6, atol=1e-6)
    assert patterns() == {"linear_bias": {"matched": 1, "ops": 2}}


# -- when a pattern must not apply ---------------------------------------------------------


def test_softmax_not_matched_when_an_intermediate_escapes():
    x = torch.randn(4, 8)
    (d,) = on_device(x)
    e = torch.exp(d - d.amax(-1, keepdim=True))  # the user keeps e
    out = e / e.sum(-1, keepdim=True)
    assert_same(out, softmax_by_hand(x))
    assert patterns() == {}
    assert adaptive_eager.stats()["refusals"].get("pattern: softmax, intermediate escapes or is shared") == 1
    assert_same(e, torch.exp(x - x.amax(-1, keepdim=True)))


def test_a_capture_met_again_must_be_the_same_tensor():
    """x * sigmoid(y) is no SiLU: the tree's two ``x`` captures read different tensors."""
    x, y = torch.randn(32), torch.randn(32)
    dx, dy = on_device(x, y)
    assert_same(dx * torch.sigmoid(dy), x * torch.sigmoid(y))
    assert patterns() == {}


def test_an_alternative_matches_when_the_first_does_not():
    """sigmoid(x) * x: SiLU's second alternative (the gate as the first argument)."""
    x = torch.randn(32)
    (d,) = on_device(x)
    assert_same(torch.sigmoid(d) * d, torch.sigmoid(x) * x, rtol=1e-6, atol=1e-7)
    assert patterns() == {"silu": {"matched": 1, "ops": 2}}


def test_silu_not_matched_when_the_gate_is_used_twice():
    x = torch.randn(16)
    (d,) = on_device(x)
    gate = torch.sigmoid(d)
    out = d * gate + gate  # the gate has a second reader
    del gate
    assert_same(out, x * torch.sigmoid(x) + torch.sigmoid(x))
    assert patterns() == {}


def test_softmax_over_two_different_dims_is_not_softmax():
    x = torch.randn(4, 8)
    (d,) = on_device(x)
    e = torch.exp(d - d.amax(-1, keepdim=True))
    out = e / e.sum(0, keepdim=True)  # normalized over another dim
    expected_e = torch.exp(x - x.amax(-1, keepdim=True))
    assert_same(out, expected_e / expected_e.sum(0, keepdim=True))
    assert patterns() == {}


def test_gelu_with_other_constants_runs_op_by_op():
    def almost_gelu(h, c):
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + c * torch.pow(h, 3.0))))

    x = torch.randn(32)
    (d,) = on_device(x)
    assert_same(almost_gelu(d, 0.044715), almost_gelu(x, 0.044715), rtol=1e-6, atol=1e-6)
    # same structure, so the cached plan applies; the launch sees another constant
    assert_same(almost_gelu(d, 0.5), almost_gelu(x, 0.5), rtol=1e-6, atol=1e-6)


def test_patterns_can_be_switched_off(policy):
    policy.patterns = False
    x = torch.randn(8, 32)
    (d,) = on_device(x)
    assert_same(softmax_by_hand(d), softmax_by_hand(x))
    assert patterns() == {}


# -- library kernels in training, and inside larger kernels -----------------------------------


def test_rms_norm_in_training_writes_back_what_autograd_keeps():
    """Autograd keeps rsqrt(...) and the normalized input for backward: they escape, and
    the library kernel writes them back too instead of giving up the match."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32)
    norm.weight.data.uniform_(0.5, 1.5)
    device_norm = LlamaRMSNorm(32).to("neuron")
    device_norm.load_state_dict(norm.state_dict())
    x = torch.randn(4, 8, 32, requires_grad=True)
    (d,) = on_device(x.detach())
    d.requires_grad_(True)
    out = device_norm(d)
    out.sum().backward()
    norm(x).sum().backward()
    assert_same(d.grad, x.grad, rtol=1e-5, atol=1e-6)
    assert_same(device_norm.weight.grad, norm.weight.grad, rtol=1e-5, atol=1e-5)
    assert patterns()["rms_norm"] == {"matched": 1, "ops": 6}


def test_rms_norm_not_matched_when_the_variance_escapes():
    """mean(x**2) is not something the library kernel gives back: keeping it refuses."""
    x, w = torch.randn(4, 32), torch.rand(32) + 0.5
    dx, dw = on_device(x, w)
    variance = dx.pow(2).mean(-1, keepdim=True)  # the user keeps it
    out = dw * (dx * torch.rsqrt(variance + 1e-6))
    assert_same(out, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), rtol=1e-5, atol=1e-6)
    assert patterns() == {}
    assert_same(variance, x.pow(2).mean(-1, keepdim=True))


def test_library_kernel_joins_its_neighbours_under_the_on_chip_rule(policy):
    """A matched chain is one unit inside a larger kernel when the working set fits on
    chip: the pattern still counts, and the launch count does not grow."""
    policy.on_chip_bytes = 24 << 20
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32)
    device_norm = LlamaRMSNorm(32).to("neuron")
    device_norm.load_state_dict(norm.state_dict())
    x, w1, w2 = torch.randn(16, 32), torch.randn(32, 32), torch.randn(32, 8)
    dx, dw1, dw2 = on_device(x, w1, w2)
    with torch.no_grad():
        assert_same(device_norm(dx @ dw1) @ dw2, norm(x @ w1) @ w2, rtol=1e-5, atol=1e-5)
    assert patterns() == {"rms_norm": {"matched": 1, "ops": 6}}
    assert adaptive_eager.stats()["kernels_launched"] == 1
    assert kernel_names() == ["mm|rms_norm(pow|mean|add|rsqrt|mul|mul)|mm"]


def test_built_kernel_runs_its_library_kernels(policy):
    policy.on_chip_bytes = 24 << 20
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32)
    device_norm = LlamaRMSNorm(32).to("neuron")
    device_norm.load_state_dict(norm.state_dict())
    w = torch.randn(32, 32)
    (dw,) = on_device(w)
    for _ in range(4):
        x = torch.randn(16, 32)
        with torch.no_grad():
            assert_same(torch.tanh(device_norm(x.to("neuron") @ dw)), torch.tanh(norm(x @ w)), rtol=1e-5, atol=1e-5)
    cache = adaptive_eager.stats()["kernel_cache"]
    assert cache["built"] >= 1 and cache["op_by_op"] == 0


# -- attention -----------------------------------------------------------------------------


def eager_attention(q, k, v, mask=None, scale=None, fill=None):
    """Hugging Face's eager attention (scale, additive mask) or GPT-2's (masked_fill)."""
    weights = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.size(-1) ** -0.5)
    if mask is not None:
        weights = weights + mask
    if fill is not None:
        weights = weights.masked_fill(fill, float("-inf"))
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def qkv(batch=2, heads=4, length=8, dim=16):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, length, dim, generator=generator) for _ in range(3)]


def causal(length=8):
    return torch.full((length, length), float("-inf")).triu(1)[None, None]


@pytest.mark.parametrize("masking", ["none", "additive", "masked_fill"])
def test_attention_written_out_is_scaled_dot_product_attention(masking):
    q, k, v = qkv()
    dq, dk, dv = on_device(q, k, v)
    mask = causal() if masking == "additive" else None
    fill = (torch.tril(torch.ones(8, 8)) == 0)[None, None] if masking == "masked_fill" else None
    device_mask = mask.to("neuron") if mask is not None else None
    device_fill = fill.to("neuron") if fill is not None else None
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    with torch.no_grad():
        out = eager_attention(dq, dk, dv, device_mask, fill=device_fill)
        # the same ops, the scores updated in place: bit for bit the CPU's
        assert_same(out, eager_attention(q, k, v, mask, fill=fill), rtol=0, atol=0)
    assert patterns()["attention"] == {"matched": 1, "ops": 4 if masking == "none" else 5}
    assert adaptive_eager.stats()["kernels_launched"] == 1


@pytest.mark.parametrize("masking", ["additive", "masked_fill"])
def test_attention_in_training_writes_back_the_weights_backward_needs(masking):
    q, k, v = qkv()
    mask = causal() if masking == "additive" else None
    fill = (torch.tril(torch.ones(8, 8)) == 0)[None, None] if masking == "masked_fill" else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    device_leaves = [t.to("neuron").requires_grad_(True) for t in (q, k, v)]
    device_mask = mask.to("neuron") if mask is not None else None
    device_fill = fill.to("neuron") if fill is not None else None
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    eager_attention(*device_leaves, device_mask, fill=device_fill).pow(2).sum().backward()
    eager_attention(*leaves, mask, fill=fill).pow(2).sum().backward()
    for device_leaf, leaf in zip(device_leaves, leaves):
        assert_same(device_leaf.grad, leaf.grad, rtol=0, atol=0)
    assert patterns()["attention"]["matched"] == 1


def test_attention_in_training_moves_q_k_v_o_and_the_logsumexp_only():
    """Modelled as a flash kernel: the scores never leave on-chip memory; autograd's kept
    softmax output is charged as one float32 per row (the logsumexp its backward uses)."""
    q, k, v = qkv()
    fill = (torch.tril(torch.ones(8, 8)) == 0)[None, None]
    device_leaves = [t.to("neuron").requires_grad_(True) for t in (q, k, v)]
    (device_fill,) = on_device(fill)
    out = eager_attention(*device_leaves, fill=device_fill)
    assert_same(out, eager_attention(q, k, v, fill=fill), rtol=0, atol=0)
    assert patterns()["attention"] == {"matched": 1, "ops": 5}
    rows = 2 * 4 * 8  # batch x heads x queries
    assert adaptive_eager.stats()["kernels_launched"] == 1
    assert adaptive_eager.stats()["bytes_moved"] == 4 * q.nbytes + fill.nbytes + rows * 4  # q, k, v, o; lse


@pytest.mark.parametrize("training", [False, True])
def test_cross_entropy_is_one_pass_over_the_logits(training):
    """log_softmax + nll_loss: the logits read once; in training the log-probabilities
    autograd keeps are charged as their logsumexp (one float32 per row), and the backward
    matches the CPU's."""
    logits, target = torch.randn(32, 40), torch.randint(0, 40, (32,), generator=torch.Generator().manual_seed(0))
    leaf = logits.to("neuron").requires_grad_(training)
    (device_target,) = on_device(target)
    loss = F.cross_entropy(leaf, device_target)
    cpu_leaf = logits.clone().requires_grad_(training)
    expected = F.cross_entropy(cpu_leaf, target)
    assert_same(loss, expected, rtol=0, atol=0)
    assert patterns()["cross_entropy"] == {"matched": 1, "ops": 2}
    assert adaptive_eager.stats()["kernels_launched"] == 1
    # the loss; in training also what autograd keeps: nll_loss's total weight, the lse
    kept = 4 + 32 * 4 if training else 0
    assert adaptive_eager.stats()["bytes_moved"] == logits.nbytes + target.nbytes + 4 + kept
    if training:
        loss.backward()
        expected.backward()
        assert_same(leaf.grad, cpu_leaf.grad)


@pytest.mark.parametrize("masking", ["none", "additive", "masked_fill"])
def test_attention_backward_is_one_flash_kernel(masking):
    """Autograd's backward of the attention chain (4 bmms, softmax backward, mask, scale)
    is one library kernel, bit for bit the CPU's gradients. Modelled as a flash backward:
    it reads Q, K, V, dO, O and the logsumexp, never P, and writes dQ, dK, dV (dK's
    transposed copy into its gradient's layout is its epilogue)."""
    q, k, v = qkv()
    mask = causal() if masking == "additive" else None
    fill = (torch.tril(torch.ones(8, 8)) == 0)[None, None] if masking == "masked_fill" else None
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    device_leaves = [t.to("neuron").requires_grad_(True) for t in (q, k, v)]
    device_mask = mask.to("neuron") if mask is not None else None
    device_fill = fill.to("neuron") if fill is not None else None
    out = eager_attention(*device_leaves, device_mask, fill=device_fill)
    (device_grad,) = on_device(grad)
    out.backward(device_grad)
    eager_attention(*leaves, mask, fill=fill).backward(grad)
    for device_leaf, leaf in zip(device_leaves, leaves):
        assert_same(device_leaf.grad, leaf.grad, rtol=0, atol=0)
    assert patterns()["attention_backward"] == {"matched": 1, "ops": 7 if fill is not None else 6}
    assert adaptive_eager.stats()["kernels_launched"] == 1
    rows = 2 * 4 * 8
    reads = 5 * q.nbytes + rows * 4 + (fill.nbytes if fill is not None else 0)  # Q, K, V, dO, O; lse; mask
    writes = 3 * q.nbytes + q.nbytes  # dQ, dK, dV; dK in its gradient's layout
    assert adaptive_eager.stats()["bytes_moved"] == reads + writes


def test_attention_not_matched_when_the_mask_comes_before_the_scale():
    """(q @ k^T + mask) * scale is not SDPA's order (it scales, then adds the mask)."""
    q, k, v = qkv()
    mask = torch.randn(1, 1, 8, 8)
    dq, dk, dv, dmask = on_device(q, k, v, mask)

    def mask_first(q, k, v, mask):
        return torch.matmul(F.softmax((torch.matmul(q, k.transpose(2, 3)) + mask) * 0.25, dim=-1), v)

    with torch.no_grad():
        assert_same(mask_first(dq, dk, dv, dmask), mask_first(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert "attention" not in patterns()


def test_attention_not_matched_when_softmax_runs_over_another_dim():
    q, k, v = qkv()
    dq, dk, dv = on_device(q, k, v)

    def other_dim(q, k, v):
        return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.25, dim=-2), v)

    with torch.no_grad():
        assert_same(other_dim(dq, dk, dv), other_dim(q, k, v), rtol=1e-5, atol=1e-6)
    assert "attention" not in patterns()


# -- rotary embedding ----------------------------------------------------------------------


def rotary_inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=generator)
    cos, sin = torch.randn(2, 8, 16, generator=generator), torch.randn(2, 8, 16, generator=generator)
    return q, cos, sin


def test_rotary_embedding_is_one_kernel():
    q, cos, sin = rotary_inputs()
    dq, dcos, dsin = on_device(q, cos, sin)
    out_q, out_k = apply_rotary_pos_emb(dq, dq * 2, dcos, dsin)
    expected_q, expected_k = apply_rotary_pos_emb(q, q * 2, cos, sin)
    assert_same(out_q, expected_q, rtol=1e-6, atol=1e-6)
    assert_same(out_k, expected_k, rtol=1e-6, atol=1e-6)
    assert patterns() == {"rotary": {"matched": 2, "ops": 10}}  # q and k
    # k = q * 2 is the pointwise prologue of k's rotary kernel (a pointwise library kernel)
    assert kernel_names() == ["mul|rotary(mul|neg|cat|mul|add)", "rotary(mul|neg|cat|mul|add)"]
    assert adaptive_eager.stats()["kernels_launched"] == 2


def test_rotary_embedding_in_training():
    q, cos, sin = rotary_inputs()
    leaf = q.clone().requires_grad_(True)
    (device_q, dcos, dsin) = on_device(q, cos, sin)
    device_leaf = device_q.requires_grad_(True)
    (apply_rotary_pos_emb(device_leaf, device_leaf, dcos, dsin)[0] ** 2).sum().backward()
    (apply_rotary_pos_emb(leaf, leaf, cos, sin)[0] ** 2).sum().backward()
    assert_same(device_leaf.grad, leaf.grad, rtol=1e-5, atol=1e-5)
    assert patterns()["rotary"]["matched"] == 2  # q and k


def test_rotary_not_matched_when_the_halves_are_swapped():
    """cat((x1, -x2)) rotates the other way: not the rotate_half form."""
    q, cos, sin = rotary_inputs()
    dq, dcos, dsin = on_device(q, cos, sin)

    def other_way(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., :half], -x[..., half:]), dim=-1) * sin

    assert_same(other_way(dq, dcos.unsqueeze(1), dsin.unsqueeze(1)), other_way(q, cos.unsqueeze(1), sin.unsqueeze(1)),
                rtol=1e-6, atol=1e-6)
    assert patterns() == {}


def test_rotary_not_matched_when_the_rotated_copy_escapes():
    q, cos, sin = rotary_inputs()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dq, dcos, dsin = on_device(q, cos, sin)
    rotated = rotate_half(dq)  # the user keeps it
    out = dq * dcos + rotated * dsin
    assert_same(out, q * cos + rotate_half(q) * sin, rtol=1e-6, atol=1e-6)
    assert patterns() == {}
    assert_same(rotated, rotate_half(q))


# -- real models, forward and backward -----------------------------------------------------


def _forward_backward(model, tokens):
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens.reshape(-1))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_decoder_blocks_written_as_hugging_face_writes_them(name):
    """Llama (RMSNorm, rotary, SiLU-gated MLP, eager attention) and GPT-2 (LayerNorm,
    masked_fill attention, tanh GELU): loss and every gradient as on the CPU, with the
    library kernels matched in the training step."""
    from bench.workloads import GPT, Llama

    torch.manual_seed(0)
    model = Llama(dim=64, heads=4, hidden=160, layers=1) if name == "llama" else GPT(dim=64, heads=4, layers=1, seq=16)
    device_model = copy.deepcopy(model).to("neuron")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    (device_tokens,) = on_device(tokens)
    loss, grads = _forward_backward(model, tokens)
    device_loss, device_grads = _forward_backward(device_model, device_tokens)
    assert_same(device_loss, loss, rtol=1e-5, atol=1e-5)
    for key, grad in grads.items():
        assert_same(device_grads[key], grad, rtol=1e-4, atol=1e-5)
    expected = {"rms_norm", "rotary", "attention"} if name == "llama" else {"attention"}
    assert expected <= set(patterns())


# -- optimizer steps across parameters ------------------------------------------------------


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("make", [
    lambda ps, fe: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
    lambda ps, fe: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True, foreach=fe),
    lambda ps, fe: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=fe),
], ids=["adamw", "adam_amsgrad_maximize", "sgd_nesterov"])
def test_optimizer_step_over_all_parameters_is_one_launch(make, foreach, policy):
    """Every parameter's update in one multi-tensor launch: the foreach chain fused, or
    the single-tensor chains fused horizontally. The optimizer's own ops run, so bias
    correction, weight decay, maximize and amsgrad are its own: exact against the CPU.
    (Multi-tensor ops are opaque to the loop rules: the on-chip rule, on by default,
    fuses them.)"""
    policy.on_chip_bytes = 24 << 20
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5), (16,)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator)) for s in shapes]
    device_params = [torch.nn.Parameter(p.detach().to("neuron")) for p in params]
    optimizer, device_optimizer = make(params, foreach), make(device_params, foreach)
    for step in range(3):
        for p, dp in zip(params, device_params):
            p.grad = torch.randn(p.shape, generator=generator)
            dp.grad = p.grad.to("neuron")
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        optimizer.step()
        device_optimizer.step()
        for p, dp in zip(params, device_params):
            assert_same(dp.detach(), p.detach(), rtol=0, atol=0)
        if step:  # past the first step's state initialization
            assert adaptive_eager.stats()["kernels_launched"] == 1


# -- more negative tests: one per remaining pattern -----------------------------------------


def test_log_softmax_not_matched_when_the_shifted_input_escapes():
    x = torch.randn(4, 8)
    (d,) = on_device(x)
    shifted = d - d.amax(-1, keepdim=True)  # the user keeps it
    out = shifted - torch.log(torch.exp(shifted).sum(-1, keepdim=True))
    assert_same(out, torch.log_softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert patterns() == {}
    assert_same(shifted, x - x.amax(-1, keepdim=True))


def test_gelu_erf_with_another_divisor_is_not_gelu():
    """x * 0.5 * (1 + erf(x / 2)) has GELU's shape but not its constant."""
    x = torch.randn(32)
    (d,) = on_device(x)
    assert_same(d * 0.5 * (1.0 + torch.erf(d / 2.0)), x * 0.5 * (1.0 + torch.erf(x / 2.0)), rtol=1e-6, atol=1e-7)
    assert patterns() == {}
    assert adaptive_eager.stats()["refusals"].get("pattern: gelu_erf, other constants") == 1


def test_gelu_constants_are_checked_at_every_launch():
    """Windows of the same structure share a plan; a launch with another constant runs the
    ops, and the statistics count only the launches that ran the library kernel."""
    x = torch.randn(32)
    (d,) = on_device(x)
    assert_same(d * 0.5 * (1.0 + torch.erf(d / math.sqrt(2.0))), F.gelu(x), rtol=1e-6, atol=1e-7)
    assert_same(d * 0.5 * (1.0 + torch.erf(d / 2.0)), x * 0.5 * (1.0 + torch.erf(x / 2.0)), rtol=1e-6, atol=1e-7)
    assert patterns() == {"gelu_erf": {"matched": 1, "ops": 5}}


def test_layer_norm_with_the_unbiased_variance_is_not_layer_norm():
    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    dx, dw, db = on_device(x, w, b)

    def unbiased(x, w, b):
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5) * w + b

    assert_same(unbiased(dx, dw, db), unbiased(x, w, b), rtol=1e-5, atol=1e-5)
    assert patterns() == {}


def test_linear_bias_not_matched_when_the_product_is_used_twice():
    x, w, b = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    dx, dw, db = on_device(x, w, b)
    product = dx @ dw
    out = product + db + product.sum()  # the product has a second reader
    del product
    assert_same(out, x @ w + b + (x @ w).sum(), rtol=1e-5, atol=1e-5)
    assert "linear_bias" not in patterns()
