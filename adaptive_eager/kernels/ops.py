"""The kernel library as PyTorch operators: ``torch.ops.neuron_kernels.*``, each one NKI kernel
launch per call (forward, and backward where it trains), with the public functions of
``adaptive_eager.kernels`` over them.

Each operator is a ``torch.library.custom_op`` registered as ``torch_neuronx.nki_op`` registers
one: its implementation calls the NKI kernel (on neuron tensors one launch on the device's
queue, ``nki/_torch.py``; on CPU tensors the simulator), its fake kernel is the same code on
FakeTensors (the kernel's trial gives the shapes), and training ops have ``register_autograd``
with a backward that is a kernel too. So ``torch.compile`` sees one node per call.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import attention_kernels as _attention
from . import loss_kernels as _loss
from . import mlp_kernels as _mlp
from . import norm_kernels as _norm
from . import optim_kernels as _optim


def _op(name: str, mutates_args=()):
    """``torch.library.custom_op("neuron_kernels::<name>")`` with the implementation as its fake
    kernel (as ``torch_neuronx.nki_op``)."""

    def register(fn):
        op = torch.library.custom_op(f"neuron_kernels::{name}", mutates_args=mutates_args)(fn)
        op.register_fake(fn)
        return op

    return register


def _rows(x: Tensor) -> Tensor:
    """``x`` as [N, last]: a view when it can be."""
    return x.reshape(-1, x.shape[-1])


# -- RMSNorm --------------------------------------------------------------------------------------------------


@_op("rms_norm")
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _norm.rms_norm_fwd(_rows(x), weight, eps).view(x.shape)


@_op("rms_norm_backward")
def _rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dx, dw = _norm.rms_norm_bwd(_rows(grad), _rows(x), weight, eps)
    return dx.view(x.shape), dw


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = _rms_norm_backward(grad, x, weight, ctx.eps)
    return dx, dw, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` (Llama's RMSNorm, computed in float32)."""
    return _rms_norm(x, weight, eps)


# -- RoPE -----------------------------------------------------------------------------------------------------


@_op("rope")
def _rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return _norm.rope(x, cos, sin, inverse)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _rope_grad(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rope(grad, cos, sin, not ctx.inverse), None, None, None


_rope.register_autograd(_rope_grad, setup_context=_rope_setup)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embeddings in Hugging Face's rotate-half convention: ``x * cos + rotate_half(x) * sin``
    for ``x`` [B, H, S, Dh] and ``cos``/``sin`` [S, Dh], [B, S, Dh] or [B, 1, S, Dh] (as Llama's
    rotary module gives them: the halves of the last dimension repeated)."""
    if cos.dim() == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return _rope(x, cos, sin, False)


# -- attention ------------------------------------------------------------------------------------------------


@_op("attention")
def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return _attention.flash_fwd(q, k, v, causal, scale)


@_op("attention_backward")
def _flash_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return _attention.flash_bwd(q, k, v, out, grad, lse, causal, scale)


def _flash_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros made for lse's gradient: one launch fewer
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _flash_grad(ctx, grad, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad is None:
        return None, None, None, None, None
    dq, dk, dv = _flash_backward(grad, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_flash.register_autograd(_flash_grad, setup_context=_flash_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None) -> Tensor:
    """Prefill attention (flash attention, one kernel; its backward one kernel):
    ``softmax(q @ k.T * scale + causal mask) @ v`` for q [B, H, S, Dh], k and v [B, Hkv, Sk, Dh]
    (grouped-query attention when Hkv < H), Dh <= 128."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _flash(q, k, v, causal, scale)[0]


@_op("decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, position: Tensor,
            scale: float) -> Tensor:
    return _attention.decode(q, k, v, k_cache, v_cache, position, scale)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, position: Tensor,
                     scale: float | None = None) -> Tensor:
    """One decoding step with a KV cache, one kernel: writes ``k`` and ``v`` [B, Hkv, Dh] (or
    [B, Hkv, 1, Dh]) into ``k_cache``/``v_cache`` [B, Hkv, Smax, Dh] at ``position`` [B] (int32,
    on the device), then attends ``q`` [B, H, Dh] over cache positions ``0..position[b]``.
    Returns [B, H, Dh] ([B, H, 1, Dh] for a 4-d ``q``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    squeeze = q.dim() == 4
    if squeeze:
        q, k, v = q.squeeze(2), k.squeeze(2), v.squeeze(2)
    out = _decode(q, k, v, k_cache, v_cache, position, scale)
    return out.unsqueeze(2) if squeeze else out


# -- the gated MLP and mixture of experts ---------------------------------------------------------------------


@_op("gated_mlp")
def _gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, activation: str) -> Tensor:
    return _mlp.gated_mlp_fwd(_rows(x), w_gate, w_up, w_down, activation).view(x.shape)


@_op("gated_mlp_backward")
def _gated_mlp_backward(grad: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                        activation: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, dg, du, dd = _mlp.gated_mlp_bwd(_rows(grad), _rows(x), w_gate, w_up, w_down, activation)
    return dx.view(x.shape), dg, du, dd


def _gated_mlp_setup(ctx, inputs, output):
    x, w_gate, w_up, w_down, activation = inputs
    ctx.save_for_backward(x, w_gate, w_up, w_down)
    ctx.activation = activation


def _gated_mlp_grad(ctx, grad):
    x, w_gate, w_up, w_down = ctx.saved_tensors
    return (*_gated_mlp_backward(grad, x, w_gate, w_up, w_down, ctx.activation), None)


_gated_mlp.register_autograd(_gated_mlp_grad, setup_context=_gated_mlp_setup)


def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, activation: str = "silu") -> Tensor:
    """``down(act(gate(x)) * up(x))`` (Llama's MLP: ``activation="silu"``; ``"gelu"``: GeGLU)
    with ``nn.Linear`` weights: ``w_gate``, ``w_up`` [F, D], ``w_down`` [D, F]."""
    return _gated_mlp(x, w_gate, w_up, w_down, activation)


@_op("router_top_k")
def _router_top_k(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    weights, indices = _mlp.router_top_k(_rows(logits), k, renormalize)
    return weights.view(*logits.shape[:-1], k), indices.view(*logits.shape[:-1], k)


def router_top_k(logits: Tensor, k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """The ``k`` (<= 8) largest router logits per token: ``(weights float32, indices int32)``,
    descending; weights are the softmax over the ``k`` (``renormalize``, Mixtral's) or the
    softmax over every expert's logit taken at the ``k``."""
    return _router_top_k(logits, k, renormalize)


@_op("moe")
def _moe(x: Tensor, router_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, top_k: int,
         renormalize: bool, activation: str) -> Tensor:
    return _mlp.moe_fwd(_rows(x), router_weight, w_gate, w_up, w_down, top_k, renormalize, activation).view(x.shape)


@_op("moe_backward")
def _moe_backward(grad: Tensor, x: Tensor, router_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                  top_k: int, renormalize: bool, activation: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dx, d_router, dg, du, dd = _mlp.moe_bwd(_rows(grad), _rows(x), router_weight, w_gate, w_up, w_down, top_k,
                                            renormalize, activation)
    return dx.view(x.shape), d_router, dg, du, dd


def _moe_setup(ctx, inputs, output):
    x, router_weight, w_gate, w_up, w_down, top_k, renormalize, activation = inputs
    ctx.save_for_backward(x, router_weight, w_gate, w_up, w_down)
    ctx.options = (top_k, renormalize, activation)


def _moe_grad(ctx, grad):
    return (*_moe_backward(grad, *ctx.saved_tensors, *ctx.options), None, None, None)


_moe.register_autograd(_moe_grad, setup_context=_moe_setup)


def moe(x: Tensor, router_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, top_k: int = 2,
        renormalize: bool = True, activation: str = "silu") -> Tensor:
    """A mixture-of-experts layer in one kernel (its backward one more): the router
    (``router_weight`` [E, D]), its top-k, and the experts' gated MLPs (``w_gate``, ``w_up``
    [E, F, D], ``w_down`` [E, D, F]) weighted by the routing weights (softmax over the k with
    ``renormalize``, Mixtral's; else the softmax over every expert at the k)."""
    return _moe(x, router_weight, w_gate, w_up, w_down, top_k, renormalize, activation)


# -- cross-entropy --------------------------------------------------------------------------------------------


@_op("cross_entropy")
def _cross_entropy(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    loss, lse, count = _loss.cross_entropy_fwd(logits, target, ignore_index)
    return loss.view(()), lse, count


@_op("cross_entropy_backward")
def _cross_entropy_backward(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor,
                            ignore_index: int) -> Tensor:
    return _loss.cross_entropy_bwd(logits, target, lse, grad.reshape(1), count, ignore_index)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, ignore_index = inputs
    _, lse, count = output
    ctx.mark_non_differentiable(lse, count)
    ctx.set_materialize_grads(False)  # no zeros made for their gradients: two launches fewer
    ctx.save_for_backward(logits, target, lse, count)
    ctx.ignore_index = ignore_index


def _cross_entropy_grad(ctx, grad, grad_lse, grad_count):
    logits, target, lse, count = ctx.saved_tensors
    if grad is None:
        return None, None, None
    return _cross_entropy_backward(grad, logits, target, lse, count, ctx.ignore_index), None, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
    """``F.cross_entropy(logits, target, ignore_index=ignore_index)`` (mean over the rows not
    ignored) for logits [..., V]: one kernel, its backward one kernel. An int64 target is read
    in place (its low words), never converted."""
    rows = _rows(logits)
    target = target.reshape(-1)
    if target.dtype == torch.int64:
        target = target.view(torch.int32).view(-1, 2)
    return _cross_entropy(rows, target, ignore_index)[0]


# -- AdamW ----------------------------------------------------------------------------------------------------


@_op("adamw_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "step"))
def _adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                step: Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    _optim.adamw(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, step: Tensor, *, lr: float, betas=(0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One AdamW step over every parameter, in one kernel: parameters and moments updated in place,
    ``step`` (a float32 [1] tensor on the device) incremented."""
    _adamw_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), step, float(lr), float(betas[0]),
                float(betas[1]), float(eps), float(weight_decay))


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (``amsgrad=False``, ``maximize=False``) whose step is one fused
    kernel per parameter group (``adamw_step``). The step count lives on the device."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if "step" not in group:
                group["step"] = torch.zeros(1, dtype=torch.float32, device=params[0].device)
            adamw_step(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                       [self.state[p]["exp_avg_sq"] for p in params], group["step"], lr=group["lr"],
                       betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
        return loss
