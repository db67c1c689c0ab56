"""The kernel library against plain PyTorch: launches and simulated device time per layer.

    python bench/kernel_library.py [--json]

Each row is one layer of an LLM at a small size (float32), run on ``neuron`` four ways: the
library's NKI kernel (``adaptive_eager.kernels``) in strict eager, and the plain PyTorch
formulation of the same layer in strict eager, adaptive eager (the fusion planner and its
pattern library) and compiled mode (``torch.compile(backend="neuron")``), forward and backward
where the layer trains (the optimizer: one step). Counts and times are the simulator's, so
deterministic: a kernel costs its NKI schedule on NeuronCore-v3 plus one launch, an aten kernel
or fused group the device's roofline plus one launch (``NEURON_SIM_LAUNCH_US``, 10 us).
The kernel's outputs are checked against the plain formulation's. README quotes the table.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import adaptive_eager  # noqa: E402
from adaptive_eager import kernels as K  # noqa: E402


def gen(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rms_norm_ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def attention_ref(q, k, v, causal=True):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=causal)


def mlp_ref(x, wg, wu, wd):
    return (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T


def decode_ref(q, k, v, k_cache, v_cache, position):
    rows = []
    for b in range(q.shape[0]):
        k_cache[b, :, position[b]] = k[b]
        v_cache[b, :, position[b]] = v[b]
        n = int(position[b]) + 1  # (a host read: the plain formulation slices by the position)
        rows.append(attention_ref(q[b:b + 1, :, None], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                                  causal=False)[:, :, 0])
    return torch.cat(rows)


def moe_ref(x, router, wg, wu, wd, top_k=2):
    values, index = torch.topk(x @ router.T, top_k)
    weights = torch.softmax(values, -1)
    out = torch.zeros_like(x)
    for e in range(router.shape[0]):
        out = out + (weights * (index == e)).sum(-1, keepdim=True) * mlp_ref(x, wg[e], wu[e], wd[e])
    return out


def cases():
    angles = gen(256, 32, seed=3)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return [
        ("rms_norm", "x [256, 1024]", True, lambda x, w: K.rms_norm(x, w), rms_norm_ref,
         (gen(256, 1024), gen(1024, seed=1)), ()),
        ("rope", "q [1, 8, 256, 64]", True, lambda x, c, s: K.rope(x, c, s), rope_ref,
         (gen(1, 8, 256, 64),), (cos, sin)),
        ("attention (prefill)", "q [1, 8, 256, 64], kv 2 heads", True, K.attention, attention_ref,
         (gen(1, 8, 256, 64), gen(1, 2, 256, 64, seed=1), gen(1, 2, 256, 64, seed=2)), ()),
        ("attention (decode)", "B 4, q 8 heads, kv 2 x 512 x 64", False,
         lambda q, k, v, kc, vc, p: K.decode_attention(q, k, v, kc, vc, p), decode_ref,
         (gen(4, 8, 64), gen(4, 2, 64, seed=1), gen(4, 2, 64, seed=2), gen(4, 2, 512, 64, seed=3),
          gen(4, 2, 512, 64, seed=4)), (torch.tensor([10, 100, 300, 511], dtype=torch.int32),)),
        ("gated MLP", "x [256, 512], F 1024", True, K.gated_mlp, mlp_ref,
         (gen(256, 512), gen(1024, 512, scale=0.05, seed=1), gen(1024, 512, scale=0.05, seed=2),
          gen(512, 1024, scale=0.05, seed=3)), ()),
        ("MoE", "x [64, 256], 8 experts of F 512, top-2", True, lambda *a: K.moe(*a, top_k=2), moe_ref,
         (gen(64, 256), gen(8, 256, seed=1), gen(8, 512, 256, scale=0.05, seed=2),
          gen(8, 512, 256, scale=0.05, seed=3), gen(8, 256, 512, scale=0.05, seed=4)), ()),
        ("cross-entropy", "logits [256, 8192]", True, K.cross_entropy, F.cross_entropy,
         (gen(256, 8192, scale=2),), (torch.randint(0, 8192, (256,), generator=torch.Generator().manual_seed(5)),)),
    ]


def _measure(fn, trainable, inputs, constants, compiled=False):
    """Launches and simulated us of one call (and its backward), and its outputs."""
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    if compiled:
        fn = torch.compile(fn, backend="neuron", fullgraph=False)
    out = fn(*inputs, *constants)
    if trainable:
        out.backward(torch.ones_like(out))
    torch.neuron.synchronize()
    stats = adaptive_eager.stats()
    return stats["kernels_launched"], stats["device_time_us"], out


def _fresh(tensors, trainable):
    moved = [t.to("neuron") for t in tensors]
    return [t.requires_grad_() for t in moved] if trainable else moved


def run():
    rows = []
    for name, shape, trainable, ours, plain, inputs, constants in cases():
        consts = [c.to("neuron") for c in constants]
        adaptive_eager.disable()
        _measure(ours, trainable, _fresh(inputs, trainable), consts)  # the kernel's trial, once
        kernel = _measure(ours, trainable, _fresh(inputs, trainable), consts)
        strict = _measure(plain, trainable, _fresh(inputs, trainable), [c.to("neuron") for c in constants])
        adaptive_eager.enable()
        _measure(plain, trainable, _fresh(inputs, trainable), [c.to("neuron") for c in constants])  # plans cached
        adaptive = _measure(plain, trainable, _fresh(inputs, trainable), [c.to("neuron") for c in constants])
        adaptive_eager.disable()
        compiled_fn = torch.compile(plain, backend="neuron")
        _measure(compiled_fn, trainable, _fresh(inputs, trainable), [c.to("neuron") for c in constants])
        compiled = _measure(compiled_fn, trainable, _fresh(inputs, trainable), [c.to("neuron") for c in constants])
        error = (kernel[2].detach().cpu() - strict[2].detach().cpu()).abs().max().item()
        rows.append(dict(layer=name, shape=shape, passes="fwd+bwd" if trainable else "fwd",
                         kernel=kernel[:2], strict=strict[:2], adaptive=adaptive[:2], compiled=compiled[:2],
                         max_abs_difference=error))
    rows.append(_adamw())
    return rows


def _adamw():
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    results = {}
    for label, make in (("kernel", lambda p: K.AdamW(p, lr=1e-3)),
                        ("strict", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)),
                        ("adaptive", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))):
        m = copy.deepcopy(model).to("neuron")
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.01)
        optimizer = make(m.parameters())
        adaptive_eager.enable() if label == "adaptive" else adaptive_eager.disable()
        optimizer.step()  # first step: state, the kernel's trial, plans
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        optimizer.step()
        torch.neuron.synchronize()
        stats = adaptive_eager.stats()
        results[label] = (stats["kernels_launched"], stats["device_time_us"], [p.detach().cpu() for p in m.parameters()])
    adaptive_eager.disable()
    error = max((a - b).abs().max().item() for a, b in zip(results["kernel"][2], results["strict"][2]))
    return dict(layer="AdamW step", shape="1.05M parameters, 4 tensors", passes="step",
                kernel=results["kernel"][:2], strict=results["strict"][:2],
                adaptive=results["adaptive"][:2], compiled=None, max_abs_difference=error,
                note="adaptive: torch.optim.AdamW(foreach=True)")


def table(rows) -> str:
    def cell(value):
        return "" if value is None else f"{value[0]} / {value[1]:.1f}"

    lines = ["| layer | size | pass | NKI kernel (launches / us) | plain strict | plain adaptive | plain compiled | "
             "max abs diff |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['shape']} | {r['passes']} | {cell(r['kernel'])} | {cell(r['strict'])} | "
                     f"{cell(r['adaptive'])} | {cell(r['compiled'])} | {r['max_abs_difference']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = run()
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
