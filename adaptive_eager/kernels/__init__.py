"""adaptive-eager's kernel library: NKI kernels for the layers LLMs spend their time in, callable
from PyTorch, one kernel launch each (and one for the backward pass where the layer trains).

    from adaptive_eager import kernels
    y = kernels.rms_norm(x, weight, eps=1e-6)
    q = kernels.rope(q, cos, sin)
    o = kernels.attention(q, k, v, causal=True)              # prefill: flash attention
    o = kernels.decode_attention(q, k, v, k_cache, v_cache, position)   # decode, KV cache in place
    y = kernels.gated_mlp(x, w_gate, w_up, w_down)           # SwiGLU
    w, idx = kernels.router_top_k(logits, k=2)
    y = kernels.moe(x, router_weight, w_gate, w_up, w_down, top_k=2)   # trains: router and experts
    loss = kernels.cross_entropy(logits, target)
    kernels.AdamW(model.parameters(), lr=1e-3).step()        # one kernel for every parameter

Each is a PyTorch custom operator (``torch.ops.neuron_kernels.*``): in strict and adaptive eager
one launch on the device's queue, which the planner never fuses; inside ``torch.compile`` one node
of the graph. On CPU tensors the kernels run on the simulator. The kernels are ours, written
in NKI for this library (``norm_kernels.py``, ``attention_kernels.py``, ``mlp_kernels.py``, ``loss_kernels.py``,
``optim_kernels.py``);
``docs/NKI.md`` gives their algorithms, limits and costs.
"""
from __future__ import annotations

from .ops import (AdamW, adamw_step, attention, cross_entropy, decode_attention, gated_mlp, moe, rms_norm, rope,
                  router_top_k)

__all__ = ["rms_norm", "rope", "attention", "decode_attention", "gated_mlp", "router_top_k", "moe", "cross_entropy",
           "adamw_step", "AdamW"]
