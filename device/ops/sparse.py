"""Sparse COO tensors on the device: ATen's own sparse tensor (``SparseTensorImpl``) whose
indices and values are dense neuron tensors, as a CUDA sparse tensor's are CUDA tensors.

Two halves, at the ``SparsePrivateUse1`` dispatch key:

- the structure: making a sparse tensor of device indices and values, and reading or
  re-pointing them (``_indices``, ``_values``, ``_nnz``, ``is_coalesced``, ``copy_``
  between sparse tensors, resizing) are at::native's device-generic kernels, which
  SparseCPU and SparseCUDA register too (``device/csrc/sparse.cpp``): no data moves, and
  ``t._values()`` is the values tensor itself;
- the arithmetic (``coalesce``, ``add``, ``to_dense``, ``sparse_mask``, ``index_select``,
  ``mm``, ...): one boxed fallback, :func:`run_sparse`, runs the CPU's sparse kernel on
  host copies after a sync point, as the device's dense fallback does
  (``host_ops.run_on_host``: counted in ``fallback_ops``), and its results come back as
  device tensors (``host_ops.upload_result``; a sparse result as a sparse neuron tensor
  of uploaded indices and values). A sparse argument becomes a CPU sparse tensor over
  the CPU tensors holding its indices' and values' bytes, so what the CPU kernel writes
  in place lands in device memory; a sparse argument the kernel re-points (``add_``,
  ``zero_``) takes the new indices and values.

Dense ops never reach this module: a dense neuron tensor's kernels are at the
PrivateUse1 key, and the dense hot path has no sparse check. Compressed layouts (CSR,
CSC, BSR, BSC) stay refused (``backend._refuse_sparse``).

Entry point: :func:`register`.
"""
from __future__ import annotations

import torch

from ..core.config import CONFIG
from ..core.counters import COUNTERS
from ..core.errors import poisoned_read_error, user_facing, users_error
from ..core.reasons import Flush
from ..hardware import sink
from ..hardware.execution_queue import HOST_LOCK
from ..memory.tensor import cpu_view, storage_of
from .host_ops import host_call_args, upload_result
from .op_table import HOST_READ, op_entry, overload_named

aten = torch.ops.aten
CPU = torch.device("cpu")


def register(fallback, kernels) -> None:
    """The boxed fallback at ``SparsePrivateUse1`` (``fallback``: a ``Library("_", "IMPL")``),
    and the same as a kernel (in ``kernels``, an ``aten`` IMPL library) of each op with a
    SparseCPU kernel that has none there yet: a ``CompositeExplicitAutograd`` kernel
    (``clone``, ``copy_``, ``index_select``...) would otherwise run for a sparse neuron
    tensor, as a composite outranks a fallback, where the CPU runs its sparse kernel. The
    C++ kernels of the structure (``_C.init``, device/csrc/sparse.cpp) keep their place."""
    fallback.fallback(user_facing(run_sparse), dispatch_key="SparsePrivateUse1")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and has(name, "SparseCPU") and not has(name, "SparsePrivateUse1"):
            kernels.impl(name[len("aten::"):], user_facing(_sparse_kernel(overload_named(name))), "SparsePrivateUse1")


def _sparse_kernel(op):
    """The kernel of ``op`` at SparsePrivateUse1: :func:`run_sparse`."""

    def kernel(*args, **kwargs):
        return run_sparse(op, *args, **kwargs)

    return kernel


def run_sparse(op, *args, **kwargs):
    """A sparse op on neuron tensors, under the host lock (ops issued from several threads
    reach the device one at a time, as dense ops do): :func:`_run_on_host`."""
    with HOST_LOCK:
        return _run_on_host(op, args, kwargs)


def _checked_cpu_view(tensor):
    storage = storage_of(tensor)
    if storage.poison is not None:
        raise poisoned_read_error(storage.poison)
    return cpu_view(tensor)


def host_sparse(tensor):
    """A CPU sparse tensor over the bytes of a sparse neuron tensor's indices and values
    (after a sync point: they are the kernels' results)."""
    indices, values = aten._indices.default(tensor), aten._values.default(tensor)
    return aten._sparse_coo_tensor_with_dims_and_tensors.default(
        tensor.sparse_dim(), tensor.dense_dim(), tensor.shape, _checked_cpu_view(indices), _checked_cpu_view(values),
        dtype=tensor.dtype, layout=torch.sparse_coo, device=CPU, is_coalesced=tensor.is_coalesced())


def upload_sparse(source, kwargs, upload):
    """``cpu_sparse.to('neuron')``: a sparse neuron tensor of the uploads (``upload``, the
    dense one) of its indices and values, the dtype converting the values."""
    dtype = kwargs.get("dtype") or source.dtype
    values_kwargs = {k: v for k, v in kwargs.items() if k not in ("layout", "memory_format")}
    indices = upload(source._indices(), {"device": kwargs.get("device")})
    values = upload(source._values(), values_kwargs)
    return aten._sparse_coo_tensor_with_dims_and_tensors.default(
        source.sparse_dim(), source.dense_dim(), source.shape, indices, values, dtype=dtype,
        layout=torch.sparse_coo, device=indices.device, is_coalesced=source.is_coalesced())


def _is_device_sparse(value) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo and value.device.type == "neuron"


def _to_host(value):
    """``value`` with each sparse neuron tensor replaced by its host twin."""
    if _is_device_sparse(value):
        return host_sparse(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def _write_back(device, host) -> None:
    """A sparse argument the CPU kernel changed: re-pointed to new indices and values
    (uploaded by ``copy_``, at::native's ``copy_sparse_``), or only re-flagged."""
    old_indices, old_values = aten._indices.default(device), aten._values.default(device)
    new_indices, new_values = host._indices(), host._values()
    kept = (new_indices.shape == old_indices.shape and new_values.shape == old_values.shape
            and new_indices.data_ptr() == cpu_view(old_indices).data_ptr()
            and new_values.data_ptr() == cpu_view(old_values).data_ptr())
    if kept and host.shape == device.shape and host.sparse_dim() == device.sparse_dim():
        aten._coalesced_.default(device, host.is_coalesced())
        return
    aten.copy_sparse_to_sparse_.default(device, host)


def _run_on_host(op, args, kwargs):
    """A sparse op on neuron tensors: the CPU's sparse kernel on host copies, after a
    sync point (which raises any pending deferred error first); counted as a fallback op."""
    entry = op_entry(op)
    if not CONFIG.fallback:
        raise users_error(NotImplementedError(
            f"{entry.name} on a sparse tensor runs on the CPU on the neuron device, and NEURON_FALLBACK=0 forbids it."))
    sink.synchronize(Flush.FALLBACK.of(entry.name))
    sparse_args = [_to_host(a) for a in args]
    sparse_kwargs = {k: _to_host(v) for k, v in kwargs.items()}
    host_args, host_kwargs = host_call_args(entry, sparse_args, sparse_kwargs, check_poison=True)
    try:
        result = op(*host_args, **host_kwargs)
    except Exception as error:  # the CPU's verdict on the user's arguments
        raise users_error(error)
    COUNTERS.fallback_ops[entry.name] += 1
    mutated = {index for index, _ in entry.mutated} | {name for _, name in entry.mutated}
    for position, value in enumerate(args):
        if _is_device_sparse(value) and position in mutated:
            _write_back(value, host_args[position])
    for name, value in kwargs.items():
        if _is_device_sparse(value) and name in mutated:
            _write_back(value, host_kwargs[name])
    if entry.kind is HOST_READ or _copies_to_host(entry, kwargs):
        return result
    return upload_result(entry, result, args, kwargs)


def _copies_to_host(entry, kwargs) -> bool:
    """``sparse.cpu()``, ``sparse.to('cpu')``: the result stays on the host."""
    device = kwargs.get("device")
    return entry.op is aten._to_copy.default and device is not None and torch.device(device).type != "neuron"
