"""Where an op's meta kernel and the CPU's kernel disagree: :data:`META_OVERRIDES`, the
functions ``shapes.infer`` calls instead of the meta kernel for those ops.

Entry points: :data:`META_OVERRIDES` (op -> ``override(op, meta_args, meta_kwargs)``,
returning meta results), :func:`probe_on_cpu` (output metadata from one CPU run on
zeros) and :func:`to_meta` (arguments as meta tensors, with their exact strides).

Each override exists because a sweep against the CPU found the meta kernel wrong for
the CPU (output metadata, a dtype check it skips, a check only the CPU makes); the
comment at each entry says which. An override that refuses the arguments raises, and
``shapes.infer`` hands the op to the CPU, which raises its own error at the call.
"""
from __future__ import annotations

import itertools

import torch

from .cpu_warnings import CpuWarned, cpu_warnings
from .index_checks import index_checked, index_put_checked, masked_scatter_checked


def to_meta(value):
    """``value`` with each tensor as a meta tensor of its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.Generator):
        return None
    return value


def probe_on_cpu(op, meta_args, meta_kwargs, increasing=()):
    """Output metadata as the CPU kernel gives it: run the op once on zero-filled CPU
    tensors of the same shapes (only for ops whose output metadata does not depend on the
    data, and zeros are valid inputs: indices, offsets and statistics alike). Tensors at
    the ``increasing`` argument positions hold 0, 1, 2... instead (bin edges)."""

    def cpu(value, fill):
        if isinstance(value, torch.Tensor):
            return fill(value)
        if isinstance(value, (list, tuple)):
            return type(value)(cpu(v, fill) for v in value)
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value

    def ascending(value):
        return torch.arange(value.numel(), device="cpu").to(value.dtype).reshape(value.shape)

    def zeros(value):  # with the argument's strides (a slice's too: they decide the output's)
        extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride())) if value.numel() else 0
        return torch.zeros(extent, dtype=value.dtype).as_strided(value.shape, value.stride())

    args = [cpu(v, ascending if i in increasing else zeros) for i, v in enumerate(meta_args)]
    result = op(*args, **{k: cpu(v, zeros) for k, v in meta_kwargs.items()})
    # the CPU's strides exactly (``.to("meta")`` would remake a size-1 dimension's)
    if isinstance(result, torch.Tensor):
        return to_meta(result)
    return type(result)(to_meta(r) if isinstance(r, torch.Tensor) else r for r in result)


_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _probe_reduced_precision(op, meta_args, meta_kwargs):
    """A CPU probe for bfloat16/float16 inputs, the meta kernel otherwise: ops whose
    meta kernel follows CUDA (float32 statistics) where the CPU returns statistics in the
    input's dtype."""
    first = meta_args[0] if meta_args else None
    if isinstance(first, torch.Tensor) and first.dtype in _REDUCED_PRECISION:
        return probe_on_cpu(op, meta_args, meta_kwargs)
    return op(*meta_args, **meta_kwargs)


_aten = torch.ops.aten
# Ops whose meta kernel disagrees with the CPU kernel on output metadata (found by the
# OpInfo sweep, bench/op_coverage.py). Their shapes come from a CPU probe instead:
# - batch norm in eval mode: the CPU returns empty save_mean/save_invstd;
# - embedding_bag: offset2bag and max_indices depend on the mode differently;
# - ops PyTorch has no meta kernel for, whose output metadata does not depend on the data
#   (zeros are valid inputs): without one they would run on the CPU fallback, a sync
#   point. The backward kernels of multi_margin_loss, multilabel_margin_loss,
#   fractional_max_pool3d and ctc_loss (a training step would sync at each); histogram
#   and histogramdd. (geqrf stays on the fallback: the tests' example of an op the
#   device lacks.)
# - layer norm and batch norm on bfloat16/float16: the CPU returns the mean and inverse
#   standard deviation (and batch norm's new running statistics) in the input's dtype,
#   the meta kernels in float32 as CUDA does.
# - _grouped_mm (mixture-of-experts layers in transformers): its meta kernel accepts
#   only bfloat16, as CUDA's kernel; the CPU kernel takes float32 too (the Hugging Face
#   sweep, bench/hf_models.py: 56 MoE architectures fell back on it).
META_OVERRIDES = {
    op: probe_on_cpu
    for op in (
        _aten.native_batch_norm.default,
        _aten._native_batch_norm_legit.default,
        _aten._native_batch_norm_legit.no_stats,
        _aten._native_batch_norm_legit_no_training.default,
        _aten._embedding_bag.default,
        _aten._embedding_bag_forward_only.default,
        _aten.multi_margin_loss.default,  # 1-D input, reduction="none": the meta kernel says (1,), the CPU ()
        _aten.multi_margin_loss_backward.default,
        _aten.multilabel_margin_loss_backward.default,
        _aten.fractional_max_pool3d_backward.default,
        _aten._ctc_loss_backward.default,
        _aten._ctc_loss_backward.Tensor,
        _aten.histogram.bin_ct,
        _aten._histogramdd_bin_edges.default,
        _aten._histogramdd_from_bin_cts.default,
        _aten._grouped_mm.default,
    )
}


def _probe_in_training(op, meta_args, meta_kwargs):
    """oneDNN's LSTM layer (``mkldnn_rnn_layer``, device/ops/rnn.py): its workspace has the
    size oneDNN asks for (the meta kernel says 0 elements), and exists only when autograd
    is on; the device worker runs kernels with autograd on, so the probe does too."""
    with torch.enable_grad():
        return probe_on_cpu(op, meta_args, meta_kwargs)


def _probe_bin_edges(op, meta_args, meta_kwargs):
    """histogram with its bin edges given (argument 1): a probe whose edges increase."""
    return probe_on_cpu(op, meta_args, meta_kwargs, increasing=(1,))


def _out_keeps_its_shape(op, meta_args, meta_kwargs):
    """arange/linspace/logspace with ``out=``: the CPU kernels resize ``out`` only when
    its number of elements is not the result's (a (2, 2) view takes 4 values in place,
    written through to its base), where the meta kernels resize it to 1-d whenever the
    shape differs. The meta run on an empty ``out`` gives the count (and the checks).
    When the count differs, the CPU kernel resizes ``out`` with ``resize_``, without
    ATen's resize warning, and warns as it will (arange: "The out tensor will be
    resized"): the CPU's warnings come with the result (:class:`CpuWarned`)."""
    out = meta_kwargs["out"]
    result = op(*meta_args, **dict(meta_kwargs, out=torch.empty(0, dtype=out.dtype, device="meta")))
    if out.numel() == result.numel():
        return out
    given = cpu_warnings(op, meta_args, meta_kwargs)
    return CpuWarned(op(*meta_args, **meta_kwargs), given)


def _like_first_input(op, meta_args, meta_kwargs):
    """Random ops with no meta kernel whose output is shaped like their first input: a
    CPU probe would draw from the CPU's generator on the host."""
    return torch.empty_like(meta_args[0])


META_OVERRIDES.update({
    overload: _out_keeps_its_shape
    for packet in (_aten.arange, _aten.linspace, _aten.logspace)
    for overload in (getattr(packet, name) for name in packet.overloads() if name.endswith("out"))
})
META_OVERRIDES[_aten.mkldnn_rnn_layer.default] = _probe_in_training
META_OVERRIDES.update({op: index_put_checked  # the CPU's value shape and dtype checks (index_checks.py)
                       for op in (_aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default)})
META_OVERRIDES[_aten.index.Tensor] = index_checked  # an index into an empty dimension (index_checks.py)
META_OVERRIDES[_aten.masked_scatter_.default] = masked_scatter_checked
# one sample (input of 0 or 1 dims) with reduction "none": the CPU's loss is 0-d, the
# meta kernel's has shape (1,)
META_OVERRIDES[_aten.multilabel_margin_loss_forward.default] = probe_on_cpu
META_OVERRIDES[_aten.binomial.default] = _like_first_input


def _unbatched_pool3d(op, meta_args, meta_kwargs):
    """An unbatched input (C, D, H, W) laid out channels-last-3d: the CPU's kernel gives
    its outputs that layout (strides (1, ...)), the meta kernel contiguous ones (it asks
    ``suggest_memory_format`` of a 4-d tensor, which knows only the 2-d channels-last);
    the CPU probe gives the CPU's. Batched inputs keep the meta kernel."""
    if meta_args[0].dim() == 4 and not meta_args[0].is_contiguous():
        return probe_on_cpu(op, meta_args, meta_kwargs)
    return op(*meta_args, **meta_kwargs)


META_OVERRIDES[_aten.max_pool3d_with_indices.default] = _unbatched_pool3d
META_OVERRIDES[_aten.max_pool3d_with_indices_backward.default] = _unbatched_pool3d
META_OVERRIDES[_aten._sample_dirichlet.default] = _like_first_input
META_OVERRIDES[_aten.histogram.bins_tensor] = _probe_bin_edges
META_OVERRIDES[_aten._histogramdd_from_bin_tensors.default] = _probe_bin_edges
META_OVERRIDES.update({
    op: _probe_reduced_precision
    for op in (
        _aten.native_layer_norm.default,
        _aten._batch_norm_with_update.default,
        _aten._batch_norm_with_update_functional.default,
        _aten._batch_norm_no_update.default,
        _aten._native_batch_norm_legit_functional.default,
    )
})


# Ops whose meta kernel accepts arguments the CPU rejects for their dtypes (found by
# trying users' common dtype mistakes against the CPU: `model(x.double())`, a long
# matrix times a float one, float indices, int32 targets). On neuron these were
# deferred device errors; when the check below fails, the CPU probe decides instead:
# it raises the CPU's error at once (at the user's line, as on the CPU), or gives the
# metadata where the CPU accepts the mix (bfloat16 layer norm with float32 weights).
def _one_dtype(meta_args, meta_kwargs):
    dtypes = {v.dtype for v in itertools.chain(meta_args, meta_kwargs.values()) if isinstance(v, torch.Tensor)}
    return len(dtypes) <= 1


def _argument_dtype_in(index, allowed):
    return lambda meta_args, meta_kwargs: index >= len(meta_args) or meta_args[index].dtype in allowed


def _dtypes_checked_on_cpu(check, inner):
    def override(op, meta_args, meta_kwargs):
        if not check(meta_args, meta_kwargs):
            return probe_on_cpu(op, meta_args, meta_kwargs)
        return inner(op, meta_args, meta_kwargs) if inner is not None else op(*meta_args, **meta_kwargs)

    return override


for _op, _check in (
    (_aten.mm.default, _one_dtype),
    (_aten.addmm.default, _one_dtype),
    (_aten.addbmm.default, _one_dtype),
    (_aten.mv.default, _one_dtype),
    (_aten.convolution.default, _one_dtype),
    (_aten.native_layer_norm.default, _one_dtype),
    (_aten.index_select.default, _argument_dtype_in(2, (torch.int64, torch.int32))),
    (_aten.nll_loss_forward.default, _argument_dtype_in(1, (torch.int64, torch.uint8))),
    (_aten.nll_loss2d_forward.default, _argument_dtype_in(1, (torch.int64, torch.uint8))),
    (_aten.complex.default, _one_dtype),  # real and imaginary parts of one dtype
    (_aten.polar.default, _one_dtype),  # absolute value and angle of one dtype
    (_aten.logcumsumexp.out, _one_dtype),  # out= of the input's dtype
):
    META_OVERRIDES[_op] = _dtypes_checked_on_cpu(_check, META_OVERRIDES.get(_op))
