"""Neuron tensors: plain ``torch.Tensor``s on device ``neuron`` with a real PrivateUse1
storage, as every out-of-tree backend makes them (torch_npu, TorchNeuron, OpenReg).

Entry points: :func:`device_tensor` (a tensor over a fresh storage), :func:`describe`
(what the dispatcher records of a tensor argument), :func:`storage_of`,
:func:`reference` and :func:`cpu_view` (the CPU tensor over a neuron tensor's bytes, for
host reads after a sync point).

A neuron tensor's storage is an identity: a unique address that is never dereferenced
(device memory is not host memory) and, in its context, the storage's Python side, a
:class:`DeviceStorage` that keeps the bytes in a CPU tensor (``device/csrc/memory.cpp``).
So the tensor is what PyTorch expects of any device tensor (FakeTensor fakifies it,
``untyped_storage().data_ptr()`` is an address shared by its views, autograd, views,
version counters and ``_base`` are PyTorch's own), while its bytes stay where the
simulated device's kernels, run on the CPU, read and write them without a copy: a
kernel's result becomes its storage's bytes as it is (``DeviceStorage.adopt``).

The address is deliberately not the CPU address of those bytes: the bytes do not exist
until a kernel writes them (they are made lazily), they move when a kernel's result is
adopted, and a host that read them through the address would skip the wait for the
kernels that write them. Host reads go through ``.cpu()``, ``.item()``, printing and
the rest, which are sync points; DLPack and numpy refuse a neuron tensor, as they refuse
a CUDA one.
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..core.errors import users_error
from .storage import DeviceStorage, ReinterpretRef, ViewRef

NEURON = torch.device("neuron", 0)

# describe(value) -> None when value is not a neuron tensor, else ((shape, stride,
# dtype), its DeviceStorage or None, whether it covers its storage exactly): one C call.
describe = _native.describe
# device_tensor(shape, stride, dtype, storage, nbytes): a neuron tensor over a fresh
# storage of nbytes bytes, whose Python side is ``storage`` (a DeviceStorage).
device_tensor = _native.empty


# offset_of(tensor) -> where a neuron tensor starts in its storage's allocation, in its
# own elements (its storage offset, plus a storage view's offset in the allocation), or
# -1 when that is not a whole number of elements.
offset_of = _native.offset_of


def storage_of(tensor: torch.Tensor) -> DeviceStorage:
    """A neuron tensor's DeviceStorage, made now for a storage ATen allocated that Python
    has not met (``torch.UntypedStorage(n, device="neuron")``), of its whole allocation
    (the tensor's storage may be a view of it, ``storage[a:b]``)."""
    storage = _native.side_of(tensor)
    if storage is None:
        storage = _native.attach(tensor, DeviceStorage.of_bytes)
    return storage


def reference(tensor: torch.Tensor, signature, storage: DeviceStorage, covers: bool):
    """What a kernel reads for ``tensor``: its storage when it covers it exactly, else its
    place in it (``ViewRef``), or, for another dtype or a conjugate/negative bit, a
    ``ReinterpretRef``. The place is in the storage's whole allocation: a tensor over a
    storage view (``untyped_storage()[a:b]``) starts where the view does."""
    if covers:
        return storage
    shape, stride, dtype = signature
    offset = offset_of(tensor)
    if offset < 0:  # starts inside an element: fine only when it reads nothing
        if tensor.numel():
            raise _misaligned(tensor)
        offset = 0
    conj, neg = tensor.is_conj(), tensor.is_neg()
    if dtype is storage.dtype and not conj and not neg:
        return ViewRef(storage, shape, stride, offset)
    return ReinterpretRef(storage, shape, stride, offset, dtype, conj, neg)


def _misaligned(tensor: torch.Tensor) -> Exception:
    return users_error(NotImplementedError(
        f"a {tensor.dtype} tensor over a storage view that starts inside an element of the "
        f"storage it views (a view made by untyped_storage()[a:b] with a not a multiple of "
        f"{tensor.element_size()}) is not supported on the neuron device; slice the storage "
        "at a whole element, or copy the bytes to the CPU first"
    ))


def cpu_view(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor over ``tensor``'s bytes (making them if nothing has written them).
    Only reads after a sync see the kernels' results."""
    signature, storage, covers = describe(tensor)
    if storage is None:
        storage = storage_of(tensor)
    ref = reference(tensor, signature, storage, covers)
    data = storage.materialize()
    return data if ref is storage else ref.resolve(data)
