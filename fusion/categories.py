"""Op categories for fusion, as plain sets of aten op names.

Entry point: :func:`category` (cached per op name).

- ``POINTWISE``: one output element from the same-position input elements, with
  broadcasting (aten's ``pointwise`` tag, plus casts, ``where``, fills and copies), or
  from one indexed element (``cat``, ``embedding``, ``nll_loss_backward``);
- ``REDUCTION``: reduces dimensions (aten's ``reduction`` tag, softmax-like ops);
- ``MATMUL``: matmul-like (mm, addmm, bmm, baddbmm, convolution, attention);
- ``RANDOM``: draws from the device generator (``nondeterministic_seeded``, or takes a
  ``generator``: ``binomial`` is not tagged); fusible
  like pointwise, but kept in program order by a generator dependency;
- ``FOREACH``: multi-tensor pointwise ops (``_foreach_add_``, ``_foreach_addcdiv``...:
  an optimizer step over every parameter): pointwise over each position of their tensor
  lists, so a chain of them over the same tensor group is one loop nest per position,
  as ``_fused_adamw_`` runs (the loop rules fuse them by that group's shape);
- ``OPAQUE``: known aten ops that run as a kernel of their own (index_put, scatter,
  sort...): they stay in the window, they just do not fuse;
- ``KERNEL``: a custom kernel (an NKI kernel, ``device/ops/custom_kernels.py``): a
  whole kernel of its own, written for the device; it stays in the window, runs alone,
  never fuses (not even by the on-chip rule: it has the NeuronCore to itself) and is
  fallible (it may fail on its data, an index out of bounds);
- ``BARRIER``: anything unknown (ops outside the aten namespace): the window is flushed
  before it, and it runs alone.

Views never reach the window (they run on the host), and host reads, data-dependent ops
and CPU fallbacks are sync points, which flush the window before they run.
"""
from __future__ import annotations

import functools

import torch
from adaptive_eager_device.ops.custom_kernels import is_custom_kernel

POINTWISE = "pointwise"
REDUCTION = "reduction"
MATMUL = "matmul"
RANDOM = "random"
FOREACH = "foreach"
OPAQUE = "opaque"
KERNEL = "kernel"
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
    # pointwise over their output, each element read from one place of an input, as a
    # compiler fuses them: cat (an output element reads one of its inputs' elements; the
    # planner gives it its inputs' iteration spaces too, so their producers fuse with
    # it), an embedding gather (one row of the table per index), and nll_loss's backward
    # (a scatter of one value per row into a zero gradient)
    "aten::cat", "aten::embedding", "aten::nll_loss_backward",
    # generators: pointwise over their output, reading nothing
    "aten::arange", "aten::ones", "aten::zeros",
}
REDUCTION_EXTRA = {
    "aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
    "aten::_log_softmax_backward_data", "aten::var_mean", "aten::logsumexp",
    "aten::linalg_vector_norm", "aten::norm",
    # normalizations: a reduction over the normalized dims and pointwise work around it
    "aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::native_group_norm",
    "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training", "aten::native_batch_norm_backward",
    # a gather and sum of one value per row (cross-entropy's loss); a scatter-add of the
    # gradient's rows into the table's (over the gradient's elements, with a prologue)
    "aten::nll_loss_forward", "aten::embedding_dense_backward",
}
# foreach ops that reduce each tensor (not pointwise)
FOREACH_REDUCTIONS = {"aten::_foreach_norm", "aten::_foreach_max"}
MATMUL_OPS = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
    "aten::_convolution", "aten::convolution_backward", "aten::addmv", "aten::mv", "aten::dot",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


@functools.lru_cache(maxsize=None)
def _category_of(name: str, tags: frozenset, takes_generator: bool) -> str:
    if name in MATMUL_OPS:
        return MATMUL
    if torch.Tag.nondeterministic_seeded in tags or takes_generator:
        return RANDOM
    if name in POINTWISE_EXTRA or torch.Tag.pointwise in tags:
        return POINTWISE
    if name.startswith("aten::_foreach_") and name not in FOREACH_REDUCTIONS:
        return FOREACH
    if name in REDUCTION_EXTRA or torch.Tag.reduction in tags:
        return REDUCTION
    if name.startswith(("aten::", "neuron::")):
        return OPAQUE
    return BARRIER


CATEGORY_BY_OP: dict = {}  # op -> category; hot paths may read it before calling category()

# Arguments whose *values* an op checks while it runs (an index out of range raises on
# the device): ops that take one are fallible.
_CHECKED_ARGUMENTS = {"index", "indices", "target", "targets", "offsets", "sorter", "repeats"}
# Integer division by zero raises (ZeroDivisionError) as the kernel runs.
_INTEGER_DIVISIONS = {"aten::div", "aten::div_", "aten::remainder", "aten::remainder_", "aten::fmod",
                      "aten::fmod_", "aten::floor_divide", "aten::floor_divide_"}
_FALLIBLE_BY_OP: dict = {}


def fallible(record) -> bool:
    """Is this op's place in program order observable? It can fail on the values of its
    inputs (not only on their shapes, which the host checks: an index out of range,
    integer division by zero), or it is random (its draws depend on the draws before it;
    some also check their probabilities). The dependency graph runs no later op before
    such an op (``window_graph.py``, ``ordered`` edges)."""
    op = record.op
    known = _FALLIBLE_BY_OP.get(op)
    if known is None:
        schema = op._schema
        if category(op) in (RANDOM, KERNEL) or any(
            argument.name in _CHECKED_ARGUMENTS and "Tensor" in str(argument.type) for argument in schema.arguments
        ):
            known = True
        elif schema.name in _INTEGER_DIVISIONS:
            known = "integers"
        else:
            known = False
        _FALLIBLE_BY_OP[op] = known
    if known == "integers":
        return any(not storage.dtype.is_floating_point and not storage.dtype.is_complex for storage in record.reads)
    return known


def category(op) -> str:
    """The fusion category of an ``OpOverload`` (cached per overload)."""
    kind = CATEGORY_BY_OP.get(op)
    if kind is None:
        if is_custom_kernel(op):
            kind = CATEGORY_BY_OP[op] = KERNEL
            return kind
        takes_generator = any(argument.name == "generator" for argument in op._schema.arguments)
        kind = CATEGORY_BY_OP[op] = _category_of(op._schema.name, frozenset(op.tags), takes_generator)
    return kind
