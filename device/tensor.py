"""The ``neuron`` tensor type: a wrapper subclass whose every aten op we intercept.

Entry points: :class:`NeuronTensor`, :func:`wrap_fresh` (a tensor over a new storage),
:func:`wrap_view` (a tensor aliasing an existing storage) and :func:`cpu_view` (the CPU
tensor that holds a neuron tensor's bytes, for host-side reads after a sync).

A ``NeuronTensor`` carries only metadata (sizes, strides, dtype, ``device='neuron:0'``)
plus three slots:

- ``_storage``: its :class:`DeviceStorage` (views share their base's);
- ``_ref``: what a kernel reads for it: the storage itself when the tensor covers it as
  allocated, or a :class:`ViewRef` (storage, shape, stride, offset) otherwise. A view costs
  no device memory and touches no data: its ``ViewRef`` is resolved to a CPU view only
  when a kernel runs (``as_strided`` over the storage's bytes, or over the value a fused
  kernel keeps in registers);
- ``_sig``: ``(shape, stride, dtype)``, its part of an op signature (cache keys).

Printing, pickling and ``copy.deepcopy`` behave as for CUDA tensors: they copy the data
to the host first (a sync point).
"""
from __future__ import annotations

import copy

import torch
from torch._C import _current_graph_task_id
from torch._tensor_str import PRINT_OPTS, _add_suffixes, _tensor_str

from .storage import DeviceStorage, ViewRef, storage_nbytes

NEURON = torch.device("neuron", 0)
_DEVICE_ATTRIBUTES = frozenset({"_storage", "_ref", "_sig"})
_make_wrapper = torch.Tensor._make_wrapper_subclass


class NeuronTensor(torch.Tensor):
    # No __slots__: torch.utils.swap_tensors (nn.Module._apply, below) swaps only tensors
    # with the same slots as a plain Parameter; the three attributes live in __dict__.

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _acquire()  # the host side is one critical section (queue.HOST_LOCK)
        try:
            return _dispatch(func, args, kwargs)
        except Exception as error:
            if _current_graph_task_id() == -1:  # not inside backward: raise as usual
                raise
            result = _defer_in_backward(func, args, kwargs, error)
            if result is None:
                raise
            return result
        finally:
            _release()

    # -- host-side representations (each a sync point) ------------------------------
    def __repr__(self, *, tensor_contents=None) -> str:
        data = self.detach().cpu()
        indent = len("tensor(")
        suffixes = [f"device='{self.device}'"]
        has_default_dtype = self.dtype in (torch.get_default_dtype(), torch.int64, torch.bool)
        if data.numel() == 0:
            contents = "[]"
            if data.dim() != 1:
                suffixes.append(f"size={tuple(data.shape)}")
            if self.dtype != torch.get_default_dtype():
                suffixes.append(f"dtype={self.dtype}")
        else:
            contents = _tensor_str(data, indent)
            if not PRINT_OPTS.edgeitems:
                suffixes.append(f"size={tuple(data.shape)}")
            if not has_default_dtype:
                suffixes.append(f"dtype={self.dtype}")
        grad_fn = self.grad_fn
        if grad_fn is not None:
            suffixes.append(f"grad_fn=<{type(grad_fn).__name__}>")
        elif self.requires_grad:
            suffixes.append("requires_grad=True")
        text = _add_suffixes("tensor(" + contents, suffixes, indent, force_newline=False)
        if isinstance(self, torch.nn.Parameter):
            return "Parameter containing:\n" + text
        return text

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    # Declaring the (un)flatten protocol makes nn.Module._apply swap each parameter in
    # place (torch.utils.swap_tensors) instead of wrapping a new Parameter per module:
    # `.to('neuron')` then keeps tied weights tied. Tracing through a neuron tensor is not
    # supported, and says so.
    def __tensor_flatten__(self):
        raise NotImplementedError("torch.compile and tracing are not supported on the neuron device")

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        raise NotImplementedError("torch.compile and tracing are not supported on the neuron device")

    def tolist(self):
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return self.cpu().numpy(force=True)
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
            "copy the tensor to host memory first."
        )

    def __dlpack__(self, *args, **kwargs):
        raise RuntimeError(
            f"can't export a {self.device} tensor through DLPack: no consumer knows the device, and "
            "a capsule is read without waiting for the device. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )

    def __dlpack_device__(self):
        self.__dlpack__()

    def __array__(self, dtype=None, copy=None):
        return self.numpy().astype(dtype, copy=False) if dtype is not None else self.numpy()

    def __reduce_ex__(self, protocol):
        # Saved as CPU data plus the device it came from; torch.load's map_location
        # applies, and weights_only loading accepts it.
        if isinstance(self, torch.nn.Parameter):
            return (
                torch._utils._rebuild_parameter,
                (self.detach(), self.requires_grad, {}),
            )
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad),
        )

    def __deepcopy__(self, memo):
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol at the moment."
            )
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()  # a kernel: it reads the data after every kernel writing it
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        # the user's attributes; the device's own (storage, reference, signature) are the
        # clone's and must stay so
        for name, value in self.__dict__.items():
            if name not in _DEVICE_ATTRIBUTES:
                setattr(new, name, copy.deepcopy(value, memo))
        memo[id(self)] = new
        return new


def wrap_fresh(spec_shape, spec_stride, dtype, storage: DeviceStorage, signature) -> NeuronTensor:
    tensor = _make_wrapper(NeuronTensor, spec_shape, strides=spec_stride, dtype=dtype, device=NEURON)
    tensor._storage = storage
    tensor._ref = storage
    tensor._sig = signature
    return tensor


def wrap_view(storage: DeviceStorage, shape, stride, offset: int, dtype) -> NeuronTensor:
    """A neuron tensor aliasing ``storage`` with the given metadata (a view)."""
    tensor = _make_wrapper(NeuronTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=NEURON)
    tensor._storage = storage
    if offset == 0 and shape == storage.shape and stride == storage.stride and dtype is storage.dtype:
        tensor._ref = storage
    else:
        tensor._ref = ViewRef(storage, shape, stride, offset)
    tensor._sig = (shape, stride, dtype)
    storage.add_view(tensor)
    return tensor


def wrap_storage(storage: DeviceStorage) -> NeuronTensor:
    """A neuron tensor covering ``storage`` exactly as allocated."""
    return wrap_fresh(storage.shape, storage.stride, storage.dtype, storage, (storage.shape, storage.stride, storage.dtype))


_META_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


def set_wrapper_metadata(tensor: NeuronTensor, shape, stride, offset: int) -> None:
    """Change a neuron tensor's sizes, strides and offset in place, touching no data.

    The Meta kernels of ``as_strided_`` and ``set_`` do exactly this to the wrapper; a
    wrapper's placeholder storage only bounds-checks, so growing past it takes the
    placeholder storage of a larger wrapper.
    """
    needed = storage_nbytes(shape, stride, tensor.element_size()) + offset * tensor.element_size()
    placeholder = tensor.untyped_storage()
    if needed > placeholder.nbytes():
        donor = _make_wrapper(NeuronTensor, (needed,), dtype=torch.uint8, device=NEURON)
        placeholder = donor.untyped_storage()
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(_META_KEYS, tensor, placeholder, offset, shape, stride)


def cpu_view(tensor: NeuronTensor) -> torch.Tensor:
    """The CPU tensor holding ``tensor``'s bytes (allocating the storage if needed).
    Only reads after a sync see the kernels' results."""
    ref = tensor._ref
    if type(ref) is DeviceStorage:
        return ref.materialize()
    if type(ref) is ViewRef:
        return ref.resolve(ref.storage.materialize())
    return ref  # a CPU tensor over the storage's bytes (dtype views)


from .dispatch import defer_in_backward as _defer_in_backward  # noqa: E402  (dispatch needs NeuronTensor)
from .dispatch import dispatch as _dispatch  # noqa: E402
from .queue import HOST_LOCK as _HOST_LOCK  # noqa: E402

_acquire, _release = _HOST_LOCK.acquire, _HOST_LOCK.release
