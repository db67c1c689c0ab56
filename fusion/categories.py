"""Op categories for fusion, as plain sets of aten op names.

Entry point: :func:`category` (cached per op name).

- ``POINTWISE``: one output element from the same-position input elements, with
  broadcasting (aten's ``pointwise`` tag, plus casts, ``where``, fills and copies);
- ``REDUCTION``: reduces dimensions (aten's ``reduction`` tag, softmax-like ops);
- ``MATMUL``: matmul-like (mm, addmm, bmm, baddbmm, convolution, attention);
- ``RANDOM``: draws from the device generator (``nondeterministic_seeded``); fusible
  like pointwise, but kept in program order by a generator dependency;
- ``OPAQUE``: known aten ops that run as a kernel of their own (embedding, cat, scatter,
  layer norm...): they stay in the window, they just do not fuse;
- ``BARRIER``: anything unknown (ops outside the aten namespace): the window is flushed
  before it, and it runs alone.

Views never reach the window (they run on the host), and host reads, data-dependent ops
and CPU fallbacks are sync points, which flush the window before they run.
"""
from __future__ import annotations

import functools

import torch

POINTWISE = "pointwise"
REDUCTION = "reduction"
MATMUL = "matmul"
RANDOM = "random"
OPAQUE = "opaque"
BARRIER = "barrier"

POINTWISE_EXTRA = {
    "aten::_to_copy", "aten::copy_", "aten::fill_", "aten::zero_", "aten::clone",
    "aten::where", "aten::masked_fill", "aten::masked_fill_", "aten::_masked_scale",
    "aten::threshold_backward", "aten::gelu_backward", "aten::silu_backward",
    "aten::sigmoid_backward", "aten::tanh_backward", "aten::native_dropout_backward",
    "aten::hardtanh_backward", "aten::leaky_relu_backward", "aten::elu_backward",
    "aten::softplus_backward", "aten::lerp_", "aten::lerp", "aten::addcmul_", "aten::addcdiv_",
    "aten::addcmul", "aten::addcdiv", "aten::fill", "aten::full_like", "aten::zeros_like",
    "aten::ones_like", "aten::scalar_tensor", "aten::full", "aten::triu", "aten::tril",
}
REDUCTION_EXTRA = {
    "aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
    "aten::_log_softmax_backward_data", "aten::var_mean", "aten::logsumexp",
    "aten::linalg_vector_norm", "aten::norm",
    # normalizations: a reduction over the normalized dims and pointwise work around it
    "aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::native_group_norm",
    "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training", "aten::native_batch_norm_backward",
}
MATMUL_OPS = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
    "aten::_convolution", "aten::convolution_backward", "aten::addmv", "aten::mv", "aten::dot",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


@functools.lru_cache(maxsize=None)
def _category_of(name: str, tags: frozenset) -> str:
    if name in MATMUL_OPS:
        return MATMUL
    if torch.Tag.nondeterministic_seeded in tags or name.startswith("neuron::native_dropout"):
        return RANDOM
    if name in POINTWISE_EXTRA or torch.Tag.pointwise in tags:
        return POINTWISE
    if name in REDUCTION_EXTRA or torch.Tag.reduction in tags:
        return REDUCTION
    if name.startswith(("aten::", "neuron::")):
        return OPAQUE
    return BARRIER


CATEGORY_BY_OP: dict = {}  # op -> category; hot paths may read it before calling category()


def category(op) -> str:
    """The fusion category of an ``OpOverload`` (cached per overload)."""
    kind = CATEGORY_BY_OP.get(op)
    if kind is None:
        kind = CATEGORY_BY_OP[op] = _category_of(op._schema.name, frozenset(op.tags))
    return kind
