"""The host-side checks of ``index_put`` that its meta kernel skips.

Entry points: :func:`index_put_checked`, a meta override (``meta_overrides.META_OVERRIDES``) of
``index_put``, ``index_put_`` and ``_index_put_impl_`` (``x[index] = values``),
:func:`index_checked`, the meta override of ``index`` (``x[index]``),
:func:`masked_scatter_checked` (an in-place write cannot broadcast its target), and
:func:`refuse_device_indices_of_a_host_tensor`.

An integer index of any element into a dimension of size 0 is out of range whatever its
values: the shapes tell, so both overrides refuse it (the CPU raises its ``IndexError``
at the call), where an index out of range of a non-empty dimension is data, a device
error deferred to the next sync point.

The meta kernel of ``index_put`` checks neither that the index tensors broadcast
together, nor that the values broadcast to the indexing result, nor that the values have
the destination's dtype: the CPU kernel checks all three before it reads any data, so on
neuron they were deferred device errors. Here they run on the meta tensors (a shape-cache
miss only: the signature holds every shape and dtype they read), and a call they refuse
is handed to the CPU (``shapes.MetaRejected``), which raises its own error at the call.

A boolean (or uint8) mask index selects as many elements as it holds True values: the
indexing result's shape is data. Values of one element broadcast to any count, so they
are queued as usual (``x[mask] = 0``, the common case); other values need the count, so
the call runs on the host, a sync point as on CUDA (whose ``index_put_`` turns the mask
into indices with ``nonzero``), which checks them against the real count.
"""
from __future__ import annotations

import torch

from ..core.errors import users_error

_MASKS = (torch.bool, torch.uint8)
_aten = torch.ops.aten
_index = _aten.index.Tensor
INDEXING = {_index, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}


class NeedsTheData(Exception):
    """Raised by a meta override when only the data can tell the call's validity (values
    of several elements under a mask): the op runs on the host after a sync point, as a
    data-dependent op (``Flush.DATA_DEPENDENT``), not as a fallback."""


def has_mask(indices) -> bool:
    """Is any of an indexing op's indices a mask (bool or uint8), whose count of True is
    the indexing result's shape?"""
    return any(index is not None and index.dtype in _MASKS for index in indices)


def refuse_device_indices_of_a_host_tensor(entry, indexed) -> None:
    """An indexing op whose indexed tensor (argument 0) is a host tensor reaches the device
    for its device indices: ATen's error, which its meta check (indices on the CPU or on
    the indexed tensor's device) raises on CUDA and cannot raise on meta tensors."""
    if isinstance(indexed, torch.Tensor) and indexed.device.type == "cpu":
        raise users_error(RuntimeError("indices should be either on cpu or on the same device as "
                                       f"the indexed tensor ({indexed.device})"))


def _expandable(shape, desired) -> bool:
    """ATen's ``is_expandable_to``: ``shape`` broadcasts to ``desired`` alone."""
    if len(shape) > len(desired):
        return False
    return all(size == 1 or size == target for size, target in zip(reversed(shape), reversed(desired)))


def _argument(meta_args, meta_kwargs, index, name):
    return meta_args[index] if index < len(meta_args) else meta_kwargs[name]


def _refuse_indices_into_empty_dims(self, indices) -> None:
    for size, index in zip(self.shape, indices):
        if index is not None and size == 0 and index.numel() > 0 and index.dtype not in _MASKS:
            raise IndexError("index is out of bounds for dimension with size 0")


def index_checked(op, meta_args, meta_kwargs):
    """``index`` on meta tensors once no index points into an empty dimension."""
    _refuse_indices_into_empty_dims(_argument(meta_args, meta_kwargs, 0, "self"),
                                    _argument(meta_args, meta_kwargs, 1, "indices"))
    return op(*meta_args, **meta_kwargs)


def masked_scatter_checked(op, meta_args, meta_kwargs):
    """``masked_scatter_`` on meta tensors once its mask broadcasts to the target: the CPU
    expands the mask to ``self`` before it reads any data; the meta kernel broadcasts."""
    self = _argument(meta_args, meta_kwargs, 0, "self")
    mask = _argument(meta_args, meta_kwargs, 1, "mask")
    if not _expandable(tuple(mask.shape), tuple(self.shape)):
        raise RuntimeError(f"masked_scatter_: a mask of shape {list(mask.shape)} cannot expand to {list(self.shape)}")
    return op(*meta_args, **meta_kwargs)


def index_put_checked(op, meta_args, meta_kwargs):
    """``op`` on meta tensors once the CPU's argument checks hold; raises when they do
    not, or when only the data can tell (values of several elements under a mask)."""
    self = _argument(meta_args, meta_kwargs, 0, "self")
    indices = _argument(meta_args, meta_kwargs, 1, "indices")
    values = _argument(meta_args, meta_kwargs, 2, "values")
    if values.dtype != self.dtype:
        raise RuntimeError(f"{op.name()}: values of dtype {values.dtype} into {self.dtype}: the CPU decides")
    _refuse_indices_into_empty_dims(self, indices)
    given = [index for index in indices if index is not None]
    if has_mask(given):
        if values.numel() != 1 or values.dim() > 1:
            raise NeedsTheData(f"{op.name()}: values of shape {list(values.shape)} under a mask: the count decides")
    else:  # the result's shape, with the CPU's check that the indices broadcast together
        result = _index(self, indices) if given else self
        if not _expandable(tuple(values.shape), tuple(result.shape)):
            raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be "
                               f"broadcast to indexing result of shape {list(result.shape)}")
    return op(*meta_args, **meta_kwargs)
