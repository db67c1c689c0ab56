"""Mixed precision: ``torch.autocast('neuron', dtype=...)`` with CUDA's autocast policy.

Entry point: :func:`register_autocast`. PyTorch registers no autocast kernels for
PrivateUse1, so without this every op under ``torch.autocast('neuron')`` would fail.
We register, at the ``AutocastPrivateUse1`` dispatch key:

- a fallthrough for every op (no policy: run as is);
- CUDA's policy for the ops CUDA lists (``aten/src/ATen/autocast_mode.cpp``):
  ``LOWER`` ops (matmul, linear, conv, ...) run in the autocast dtype; ``FP32`` ops
  (pointwise transcendentals, norms, losses) run in float32; ``FP32_DTYPE`` ops
  (softmax, sum, cumsum, ...) get ``dtype=torch.float32`` unless one was given;
  ``PROMOTE`` ops (cat, stack, addcmul, ...) run in the widest input type.

As on CUDA, only floating tensors on the device are cast, and float64 is never lowered.
"""
from __future__ import annotations

import torch

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# CUDA's autocast lists, by op name; every overload of the op gets the policy.
LOWER = """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
conv_transpose3d convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear
addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell
lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
scaled_dot_product_attention""".split()
FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
softplus layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm
cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""".split()
FP32_DTYPE = "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum".split()
PROMOTE = """addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add
tensordot stack cat index_copy""".split()


def _eligible(value) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.device.type == "neuron"
    )


def _cast(value, dtype, lowering: bool):
    if _eligible(value) and value.dtype != dtype and not (lowering and value.dtype == torch.float64):
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, lowering) for v in value)
    return value


def _flat(values):
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flat(value)
        else:
            yield value


def _run(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
        return op(*args, **kwargs)


def _lower_kernel(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("neuron")
        args = _cast(args, dtype, True)
        kwargs = {k: _cast(v, dtype, True) for k, v in kwargs.items()}
        return _run(op, args, kwargs)

    return kernel


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        args = _cast(args, torch.float32, False)
        kwargs = {k: _cast(v, torch.float32, False) for k, v in kwargs.items()}
        return _run(op, args, kwargs)

    return kernel


def _fp32_dtype_kernel(op):
    has_dtype = any(a.name == "dtype" for a in op._schema.arguments)
    position = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        first = next(_flat(args), None)
        if has_dtype and _eligible(first):
            if position is not None and position < len(args):
                if args[position] is None:
                    args = args[:position] + (torch.float32,) + args[position + 1 :]
            elif kwargs.get("dtype") is None:
                kwargs = dict(kwargs, dtype=torch.float32)
        return _run(op, args, kwargs)

    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        floats = [v for v in _flat(list(args) + list(kwargs.values())) if _eligible(v)]
        if floats:
            widest = floats[0].dtype
            for value in floats[1:]:
                widest = torch.promote_types(widest, value.dtype)
            args = _cast(args, widest, False)
            kwargs = {k: _cast(v, widest, False) for k, v in kwargs.items()}
        return _run(op, args, kwargs)

    return kernel


_LIBRARIES: list = []


def register_autocast() -> None:
    if _LIBRARIES:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    library = torch.library.Library("aten", "IMPL")
    for names, factory in ((LOWER, _lower_kernel), (FP32, _fp32_kernel), (FP32_DTYPE, _fp32_dtype_kernel), (PROMOTE, _promote_kernel)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload_name in packet.overloads():
                op = getattr(packet, overload_name)
                if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
                    continue  # out= and in-place overloads are not in CUDA's policy
                qualified = name if overload_name == "default" else f"{name}.{overload_name}"
                library.impl(qualified, factory(op), "AutocastPrivateUse1")
    _LIBRARIES.extend([fallthrough, library])
