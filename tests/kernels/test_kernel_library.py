"""The kernel library (``adaptive_eager.kernels``): each kernel equal to a plain PyTorch
reference, forward and backward where it trains, in strict, adaptive and compiled mode; one
launch per kernel call; its simulated time its own schedule plus one launch."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
import nki
from adaptive_eager import kernels as K
from adaptive_eager.kernels import attention_kernels
from adaptive_eager.kernels import loss_kernels
from adaptive_eager.kernels import mlp_kernels
from adaptive_eager.kernels import norm_kernels
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.hardware.execution_queue import QUEUE
from conftest import on_device

TOL = dict(rtol=1e-4, atol=1e-5)


def launches():
    return {name: entry["launches"] for name, entry in adaptive_eager.stats()["kernels"].items()}


def gen(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def device_leaves(*tensors):
    return [t.requires_grad_() for t in on_device(*tensors)]


def check_grads(device, cpu, **tol):
    for d, c in zip(device, cpu):
        torch.testing.assert_close(d.grad.cpu(), c.grad, **(tol or TOL))


# -- references -----------------------------------------------------------------------------------------------


def rms_norm_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rope_tables(s, dh, seed=3):
    angles = gen(s, dh // 2, seed=seed)
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def attention_ref(q, k, v, causal=True):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=causal)


def gated_mlp_ref(x, wg, wu, wd, act=F.silu):
    return (act(x @ wg.T) * (x @ wu.T)) @ wd.T


def moe_ref(x, router, wg, wu, wd, top_k, renormalize=True):
    logits = x @ router.T
    values, index = torch.topk(logits, top_k)
    weights = torch.softmax(values, -1) if renormalize else torch.softmax(logits, -1).gather(1, index)
    out = torch.zeros_like(x)
    for e in range(router.shape[0]):
        out += (weights * (index == e)).sum(-1, keepdim=True) * gated_mlp_ref(x, wg[e], wu[e], wd[e])
    return out


# -- each kernel, strict and adaptive eager -------------------------------------------------------------------


def test_rms_norm(any_mode):
    x, w = gen(2, 70, 48), gen(48, seed=1)
    cpu, dev = leaves(x, w), device_leaves(x, w)
    y = K.rms_norm(*dev, 1e-6)
    (y * 3).sum().backward()
    (rms_norm_ref(*cpu) * 3).sum().backward()
    torch.testing.assert_close(y.detach().cpu(), rms_norm_ref(x, w), **TOL)
    check_grads(dev, cpu)
    assert launches()["nki::rms_norm_fwd"] == 1 and launches()["nki::rms_norm_bwd"] == 1


def test_rms_norm_bfloat16(any_mode):
    x, w = gen(64, 96).bfloat16(), gen(96, seed=1).bfloat16()
    y = K.rms_norm(*on_device(x, w))
    assert y.dtype == torch.bfloat16
    expected = rms_norm_ref(x.float(), w.float()).bfloat16()  # float32 math, rounded once
    torch.testing.assert_close(y.cpu().float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_rope(any_mode):
    x = gen(2, 3, 40, 16)
    cos, sin = rope_tables(40, 16)
    (cx,), (dx,) = leaves(x), device_leaves(x)
    dcos, dsin = on_device(cos, sin)
    y = K.rope(dx, dcos, dsin)
    (y * gen(*x.shape, seed=9).to("neuron")).sum().backward()
    (rope_ref(cx, cos, sin) * gen(*x.shape, seed=9)).sum().backward()
    torch.testing.assert_close(y.detach().cpu(), rope_ref(x, cos, sin), **TOL)
    check_grads([dx], [cx])
    assert launches()["nki::rope"] == 2  # forward, and backward (the inverse rotation)


def test_prefill_attention_with_grouped_query_heads(any_mode):
    q, k, v = gen(1, 4, 96, 32), gen(1, 2, 96, 32, seed=1), gen(1, 2, 96, 32, seed=2)
    cpu, dev = leaves(q, k, v), device_leaves(q, k, v)
    grad = gen(1, 4, 96, 32, seed=5)
    out = K.attention(*dev, causal=True)
    out.backward(grad.to("neuron"))
    attention_ref(*cpu).backward(grad)
    torch.testing.assert_close(out.detach().cpu(), attention_ref(q, k, v), **TOL)
    check_grads(dev, cpu)
    assert launches()["nki::flash_fwd"] == 1 and launches()["nki::flash_bwd"] == 1


def test_decode_attention_writes_the_cache_and_attends_up_to_its_position(any_mode):
    b, h, hkv, smax, dh = 2, 4, 2, 48, 16
    k_cache, v_cache = gen(b, hkv, smax, dh), gen(b, hkv, smax, dh, seed=1)
    q, k, v = gen(b, h, 1, dh, seed=2), gen(b, hkv, 1, dh, seed=3), gen(b, hkv, 1, dh, seed=4)
    position = torch.tensor([5, 37], dtype=torch.int32)
    dev = on_device(q, k, v, k_cache, v_cache, position)
    out = K.decode_attention(*dev)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    rows = []
    for i in range(b):
        expected_k[i, :, position[i]], expected_v[i, :, position[i]] = k[i, :, 0], v[i, :, 0]
        n = int(position[i]) + 1
        rows.append(attention_ref(q[i:i + 1], expected_k[i:i + 1, :, :n], expected_v[i:i + 1, :, :n], causal=False))
    torch.testing.assert_close(out.cpu(), torch.cat(rows), **TOL)
    torch.testing.assert_close(dev[3].cpu(), expected_k)
    torch.testing.assert_close(dev[4].cpu(), expected_v)
    assert launches() == {"nki::decode": 1}


def test_gated_mlp(any_mode):
    x, wg, wu, wd = gen(2, 50, 64), gen(96, 64, scale=0.1, seed=1), gen(96, 64, scale=0.1, seed=2), \
        gen(64, 96, scale=0.1, seed=3)
    cpu, dev = leaves(x, wg, wu, wd), device_leaves(x, wg, wu, wd)
    grad = gen(2, 50, 64, seed=4)
    y = K.gated_mlp(*dev)
    y.backward(grad.to("neuron"))
    gated_mlp_ref(*cpu).backward(grad)
    torch.testing.assert_close(y.detach().cpu(), gated_mlp_ref(x, wg, wu, wd), **TOL)
    check_grads(dev, cpu)
    assert launches()["nki::gated_mlp_fwd"] == 1 and launches()["nki::gated_mlp_bwd"] == 1


def test_router_top_k(any_mode):
    logits = gen(30, 6)
    weights, index = K.router_top_k(*on_device(logits), k=2)
    values, expected = torch.topk(logits, 2)
    assert index.dtype == torch.int32 and torch.equal(index.cpu().long(), expected)
    torch.testing.assert_close(weights.cpu(), torch.softmax(values, -1), **TOL)
    weights, _ = K.router_top_k(on_device(logits)[0], k=2, renormalize=False)
    torch.testing.assert_close(weights.cpu(), torch.topk(torch.softmax(logits, -1), 2).values, **TOL)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe(any_mode, renormalize):
    e, d, f = 4, 32, 48
    x, router = gen(20, d), gen(e, d, seed=1)
    wg, wu, wd = gen(e, f, d, scale=0.2, seed=2), gen(e, f, d, scale=0.2, seed=3), gen(e, d, f, scale=0.2, seed=4)
    cpu, dev = leaves(x, router, wg, wu, wd), device_leaves(x, router, wg, wu, wd)
    grad = gen(20, d, seed=5)
    y = K.moe(*dev, top_k=2, renormalize=renormalize)
    y.backward(grad.to("neuron"))
    moe_ref(*cpu, 2, renormalize).backward(grad)
    torch.testing.assert_close(y.detach().cpu(), moe_ref(x, router, wg, wu, wd, 2, renormalize), **TOL)
    check_grads(dev, cpu, rtol=1e-4, atol=1e-4)
    assert {name: n for name, n in launches().items() if name.startswith("nki::")} == {"nki::moe_fwd": 1,
                                                                                       "nki::moe_bwd": 1}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cross_entropy(any_mode, dtype):
    logits, target = gen(40, 300, scale=3), torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
    target[[3, 17]] = -100
    (cl,), (dl,) = leaves(logits), device_leaves(logits)
    (dt,) = on_device(target.to(dtype))
    loss = K.cross_entropy(dl, dt)
    (loss * 2).backward()
    (F.cross_entropy(cl, target) * 2).backward()
    torch.testing.assert_close(loss.detach().cpu(), F.cross_entropy(logits, target), **TOL)
    check_grads([dl], [cl])
    ours = {name: n for name, n in launches().items() if name.startswith("nki::")}
    assert ours == {"nki::cross_entropy_fwd": 1, "nki::cross_entropy_bwd": 1}  # no conversion of an int64 target


def test_fused_adamw_is_one_launch_per_step(any_mode):
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    reference = copy.deepcopy(model)
    model.to("neuron")
    optimizer = K.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    x = gen(8, 16)
    for _ in range(3):
        for m, opt, inputs in ((model, optimizer, x.to("neuron")), (reference, expected, x)):
            opt.zero_grad()
            m(inputs).pow(2).mean().backward()
            opt.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)
    assert launches()["nki::adamw"] == 3


# -- compiled mode --------------------------------------------------------------------------------------------


def test_a_compiled_transformer_block_trains_with_the_library():
    """RMSNorm, RoPE, attention, the gated MLP and cross-entropy in one compiled graph: each one
    node (one launch) forward and backward; the gradients equal plain PyTorch's."""
    b, h, s, dh, d, f, v = 1, 2, 32, 16, 32, 64, 50
    x, w_norm = gen(b, s, d), gen(d, seed=1)
    wq, wk, wv = gen(d, d, scale=0.2, seed=2), gen(d, d, scale=0.2, seed=3), gen(d, d, scale=0.2, seed=4)
    wg, wu, wd = gen(f, d, scale=0.2, seed=5), gen(f, d, scale=0.2, seed=6), gen(d, f, scale=0.2, seed=7)
    head = gen(v, d, scale=0.2, seed=8)
    target = torch.randint(0, v, (b * s,), generator=torch.Generator().manual_seed(9))
    cos, sin = rope_tables(s, dh)

    def block(x, w_norm, wq, wk, wv, wg, wu, wd, head, target, cos, sin, lib):
        norm = lib["norm"](x, w_norm)
        heads = lambda t: t.view(b, s, h, dh).transpose(1, 2)  # noqa: E731
        q, k, vv = heads(norm @ wq.T), heads(norm @ wk.T), heads(norm @ wv.T)
        q, k = lib["rope"](q, cos, sin), lib["rope"](k, cos, sin)
        att = lib["attention"](q.contiguous(), k.contiguous(), vv.contiguous()).transpose(1, 2).reshape(b, s, d)
        hidden = x + att
        hidden = hidden + lib["mlp"](hidden, wg, wu, wd)
        return lib["loss"]((hidden @ head.T).view(b * s, v), target)

    ours = dict(norm=K.rms_norm, rope=K.rope, attention=K.attention, mlp=K.gated_mlp, loss=K.cross_entropy)
    plain = dict(norm=rms_norm_ref, rope=rope_ref, attention=attention_ref, mlp=gated_mlp_ref, loss=F.cross_entropy)
    weights = (x, w_norm, wq, wk, wv, wg, wu, wd, head)
    cpu = leaves(*weights)
    dev = device_leaves(*weights)
    rest = on_device(target, cos, sin)
    compiled = torch.compile(lambda *a: block(*a, lib=ours), backend="neuron", fullgraph=True)
    loss = compiled(*dev, *rest)
    loss.backward()
    expected = block(*cpu, target, cos, sin, lib=plain)
    expected.backward()
    torch.testing.assert_close(loss.detach().cpu(), expected.detach(), **TOL)
    check_grads(dev, cpu, rtol=1e-4, atol=1e-4)
    counts = launches()
    assert {name: n for name, n in counts.items() if name.startswith("nki::")} == {
        "nki::rms_norm_fwd": 1, "nki::rms_norm_bwd": 1, "nki::rope": 4, "nki::flash_fwd": 1, "nki::flash_bwd": 1,
        "nki::gated_mlp_fwd": 1, "nki::gated_mlp_bwd": 1, "nki::cross_entropy_fwd": 1, "nki::cross_entropy_bwd": 1}
    kinds = [g["kind"] for g in adaptive_eager.stats()["compiled"]["graphs"].values() if g["calls"]]
    assert sorted(kinds) == ["backward", "forward"]  # one graph each way: no graph break


def test_compiled_decode_step_and_moe():
    b, h, hkv, smax, dh = 1, 2, 1, 32, 16
    k_cache, v_cache = gen(b, hkv, smax, dh), gen(b, hkv, smax, dh, seed=1)
    q, k, v = gen(b, h, 1, dh, seed=2), gen(b, hkv, 1, dh, seed=3), gen(b, hkv, 1, dh, seed=4)
    router, wg, wu, wd = gen(4, dh * h, seed=5), gen(4, 24, dh * h, scale=0.2, seed=6), \
        gen(4, 24, dh * h, scale=0.2, seed=7), gen(4, dh * h, 24, scale=0.2, seed=8)
    position = torch.tensor([9], dtype=torch.int32)

    def step(q, k, v, k_cache, v_cache, position, router, wg, wu, wd):
        att = K.decode_attention(q, k, v, k_cache, v_cache, position).reshape(b, h * dh)
        return K.moe(att, router, wg, wu, wd, top_k=2)

    dev = on_device(q, k, v, k_cache, v_cache, position, router, wg, wu, wd)
    out = torch.compile(step, backend="neuron", fullgraph=True)(*dev)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[:, :, 9], expected_v[:, :, 9] = k[:, :, 0], v[:, :, 0]
    att = attention_ref(q, expected_k[:, :, :10], expected_v[:, :, :10], causal=False).reshape(b, h * dh)
    torch.testing.assert_close(out.cpu(), moe_ref(att, router, wg, wu, wd, 2), **TOL)
    torch.testing.assert_close(dev[3].cpu(), expected_k)  # the cache written in place, no copy back
    assert launches() == {"nki::decode": 1, "nki::moe_fwd": 1}


# -- simulated time -------------------------------------------------------------------------------------------


def _arrays(*tensors):
    return [t.numpy() for t in tensors]


TIMED = {
    "rms_norm_fwd": (lambda x, w: K.rms_norm(x, w, 1e-5), norm_kernels.rms_norm_fwd,
                     lambda x, w: (*_arrays(x, w), 1e-5), (gen(100, 64), gen(64, seed=1))),
    "flash_fwd": (lambda q, k, v: K.attention(q, k, v, scale=0.25), attention_kernels.flash_fwd,
                  lambda q, k, v: (*_arrays(q, k, v), True, 0.25),
                  (gen(1, 2, 64, 16), gen(1, 1, 64, 16, seed=1), gen(1, 1, 64, 16, seed=2))),
    "gated_mlp_fwd": (lambda x, g, u, d: K.gated_mlp(x, g, u, d), mlp_kernels.gated_mlp_fwd,
                      lambda x, g, u, d: (*_arrays(x, g, u, d), "silu"),
                      (gen(40, 32), gen(48, 32, seed=1), gen(48, 32, seed=2), gen(32, 48, seed=3))),
    "cross_entropy_fwd": (lambda lg, t: K.cross_entropy(lg, t), loss_kernels.cross_entropy_fwd,
                          lambda lg, t: (*_arrays(lg, t), -100), (gen(20, 100), torch.arange(20, dtype=torch.int32))),
}


@pytest.mark.parametrize("name", sorted(TIMED))
def test_a_library_kernel_costs_its_schedule_plus_one_launch(strict_mode, name):
    call, kernel, numpy_args, inputs = TIMED[name]
    call(*on_device(*inputs))
    torch.neuron.synchronize()
    launched, time_us, _ = QUEUE.kernel_summary()[f"nki::{name}"]
    assert launched == 1
    schedule = nki.run(kernel, *numpy_args(*inputs)).schedule
    assert time_us == CONFIG.launch_us + schedule.device_ns / 1000  # exactly (nki.run's time_us, summed so)


def test_the_kernels_run_on_cpu_tensors_through_the_simulator():
    x, w = gen(10, 32), gen(32, seed=1)
    torch.testing.assert_close(K.rms_norm(x, w), rms_norm_ref(x, w), **TOL)
    assert np.isfinite(K.cross_entropy(gen(4, 10), torch.arange(4)).item())
