"""The pattern library in training: for each hand-written form, what adaptive eager does
with its forward and with the backward chain autograd produces for it.

    python bench/patterns.py [--json]

Each form runs forward (then a sync) and backward (then a sync) on a (4, 8, 32) input that
requires grad, each as one window, twice: with the loop rules alone
(``NEURON_ADAPTIVE_ON_CHIP_MB=0``) and with the on-chip rule (the default). It reports ops
and launches per pass and which patterns matched. Counts are deterministic. README
("Pattern library") quotes the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import adaptive_eager  # noqa: E402
from adaptive_eager.window import WindowPolicy  # noqa: E402
from bench.workloads import apply_rotary_pos_emb  # noqa: E402

_generator = torch.Generator().manual_seed(0)
WEIGHT = torch.rand(32, generator=_generator) + 0.5
MATRIX, BIAS = torch.randn(32, 16, generator=_generator), torch.randn(16, generator=_generator)
ANGLES = torch.randn(4, 8, 32, generator=_generator)


def softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def log_softmax(x):
    shifted = x - x.amax(-1, keepdim=True)
    return shifted - torch.log(torch.exp(shifted).sum(-1, keepdim=True))


def gelu_tanh(h):
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def gelu_erf(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def silu(x):
    return x * torch.sigmoid(x)


def rms_norm(x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return WEIGHT.to(x.device) * (x * torch.rsqrt(variance + 1e-6))


def layer_norm(x):
    mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + 1e-5) * WEIGHT.to(x.device) + WEIGHT.to(x.device)


def linear_bias(x):
    return x.reshape(-1, 32) @ MATRIX.to(x.device) + BIAS.to(x.device)


def attention(x):
    q = x.view(4, 8, 2, 16).transpose(1, 2)
    return torch.matmul(F.softmax(torch.matmul(q, q.transpose(2, 3)) * 0.25, dim=-1), q)


def rotary(x):
    q = x.view(4, 1, 8, 32)
    return apply_rotary_pos_emb(q, q, ANGLES.to(x.device), ANGLES.to(x.device) * 0.5)[0]


FORMS = [softmax, log_softmax, gelu_tanh, gelu_erf, silu, rms_norm, layer_norm, linear_bias, attention, rotary]


def _pass(run) -> dict:
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    result = run()
    torch.neuron.synchronize()
    stats = adaptive_eager.stats()
    return {"ops": stats["ops_recorded"], "launches": stats["kernels_launched"], "patterns": sorted(stats["patterns"]),
            "result": result}


def measure() -> list[dict]:
    adaptive_eager.enable()
    rows = []
    # one window per pass: flushed at its sync point
    with adaptive_eager.window_policy(min_ops=10**6, max_ops=10**6) as policy:
        for rule, on_chip in (("loop rules", 0), ("on-chip rule", WindowPolicy().on_chip_bytes)):
            policy.on_chip_bytes = on_chip
            adaptive_eager.clear_caches()
            for form in FORMS:
                x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).to("neuron").requires_grad_(True)
                forward = _pass(lambda: (form(x) ** 2).sum())
                backward = _pass(lambda: forward["result"].backward())
                rows.append({"form": form.__name__, "rules": rule, "forward_ops": forward["ops"],
                             "forward_launches": forward["launches"], "patterns": forward["patterns"],
                             "backward_ops": backward["ops"], "backward_launches": backward["launches"]})
    adaptive_eager.clear_caches()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = measure()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| form | rules | forward ops → launches | pattern in training | backward ops → launches |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['form']} | {row['rules']} | {row['forward_ops']} → {row['forward_launches']} | "
              f"{', '.join(row['patterns']) or 'none'} | {row['backward_ops']} → {row['backward_launches']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
