"""``scaled_dot_product_attention`` on ``neuron`` picks the kernel the CPU picks.

Entry point: :func:`register` (called once by ``backend._register_kernels``).

``scaled_dot_product_attention`` is a ``CompositeImplicitAutograd`` op: its C++ body asks
a per-device dispatch stub which backend to run (flash attention, memory-efficient,
cuDNN, ``overrideable`` or math) and runs the math decomposition on a device that
registered none, as PrivateUse1 from Python cannot (the stub is C++ only). On the CPU
the stub picks flash attention for 4-dimensional inputs without dropout
(``_scaled_dot_product_flash_attention_for_cpu``, which accumulates in float32), so the
math decomposition (``bmm`` and ``_safe_softmax`` rounding to bfloat16 at each step)
gave other bfloat16 results than the CPU's.

The device registers the op at AutogradPrivateUse1 instead: it asks the CPU's own choice
(``aten::_fused_sdp_choice``) on CPU tensors of the inputs' metadata (empty: no bytes are
read or copied), then, like the composite, runs the CPU's flash kernel (an op with its
own autograd formula, ``_scaled_dot_product_flash_attention_for_cpu_backward``) on the
device tensors, or the composite itself for any other choice (math), which also raises
the composite's errors for bad arguments. ``torch.compile`` and FakeTensor decompose the
composite above the device and are unchanged.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_FLASH = 1  # sdp::SDPBackend::flash_attention


def _like_on_cpu(tensor):
    """An empty CPU tensor with ``tensor``'s metadata (what the CPU's choice reads: shape,
    strides, dtype, and whether it requires grad: the CPU's flash kernel has no gradient
    for a mask, so a mask that requires grad makes the CPU choose math)."""
    if tensor is None:
        return None
    like = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu")
    return like.requires_grad_() if tensor.requires_grad and tensor.is_floating_point() else like


def _checked_by_the_composite(query, key, value, attn_mask) -> bool:
    """Whether the inputs pass the composite's ``validate_sdpa_input`` (one dtype and one
    device for query, key and value, at least 2 dimensions, a boolean, float or query-typed
    mask): the flash kernel skips some of these checks, so anything else goes to the
    composite, which raises its own error."""
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in tensors):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or min(t.dim() for t in (query, key, value)) < 2:
        return False
    if any(t.device != query.device for t in tensors):
        return False
    return attn_mask is None or attn_mask.dtype in (torch.bool, torch.float32, query.dtype)


def _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The backend the CPU would run for tensors of these shapes, strides and dtypes (0:
    math). Inputs the CPU's choice refuses go to the composite, which raises its error."""
    if not _checked_by_the_composite(query, key, value, attn_mask):
        return 0
    try:
        return aten._fused_sdp_choice.default(
            _like_on_cpu(query), _like_on_cpu(key), _like_on_cpu(value), _like_on_cpu(attn_mask),
            dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    except (RuntimeError, TypeError, ValueError):
        return 0


def _additive_mask(attn_mask, dtype):
    """The composite's ``convert_boolean_attn_mask``: a boolean mask (True: attend) as an
    additive one of the query's dtype (0 or -inf); any other mask as given."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros_like(attn_mask, dtype=dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """The AutogradPrivateUse1 kernel of ``aten::scaled_dot_product_attention``: the CPU's
    flash kernel where the CPU would run it, else the composite (math)."""
    if _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) == _FLASH:
        output, _ = aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=_additive_mask(attn_mask, query.dtype), scale=scale)
        return output
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def register(library: torch.library.Library) -> None:
    """Register the kernel above in ``library`` (an ``aten`` IMPL library)."""
    library.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")
