"""Memory regions, storages and allocation.

A storage is a byte buffer in SBUF, PSUM or HBM. On-chip storages are partition-major: partition
``p`` holds bytes ``[p * pbytes, (p + 1) * pbytes)``. ``allocate`` (``nl.ndarray``) counts a new
on-chip storage against the running program's SBUF/PSUM (``_state.OnChipMemory``) until the
storage is garbage; ``from_numpy`` wraps a caller's array as an HBM tensor over its own memory.
"""
from __future__ import annotations

import enum
import math
import weakref

import numpy as np

from . import _dtypes
from ._state import current, fail, maybe_current


class MemoryRegion(enum.Enum):
    """Memory region constants for NKI tensors."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    def __repr__(self):
        return f"nl.{self.value}"

    __str__ = __repr__


sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm
hbm = private_hbm  # "HBM - Alias of private_hbm"

_BUFFER_NAMES = {"sbuf": sbuf, "psum": psum, "hbm": private_hbm, "private_hbm": private_hbm,
                 "shared_hbm": shared_hbm}


def as_buffer(buffer) -> MemoryRegion:
    if isinstance(buffer, MemoryRegion):
        return buffer
    if isinstance(buffer, str) and buffer in _BUFFER_NAMES:
        return _BUFFER_NAMES[buffer]
    raise TypeError(f"{buffer!r} is not an NKI buffer (nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm, nl.private_hbm)")


def is_hbm(buffer) -> bool:
    return as_buffer(buffer) in (private_hbm, shared_hbm)


def is_on_chip(buffer) -> bool:
    return as_buffer(buffer) in (sbuf, psum)


def is_psum(buffer) -> bool:
    return as_buffer(buffer) is psum


def is_sbuf(buffer) -> bool:
    return as_buffer(buffer) is sbuf


def buffer_label(buffer) -> str:
    return {sbuf: "SBUF", psum: "PSUM", private_hbm: "HBM", shared_hbm: "shared HBM"}[as_buffer(buffer)]


class Storage:
    """The memory a tensor lives in. ``pbytes`` is the bytes per partition (on chip)."""

    __slots__ = ("id", "buffer", "data", "partitions", "pbytes", "name", "shadow", "__weakref__")

    def __init__(self, buffer, data: np.ndarray, partitions: int, pbytes: int, name: str = ""):
        program = maybe_current()
        self.id = program.shared.next_id() if program is not None else id(self)
        self.buffer = buffer
        self.data = data
        self.partitions = partitions
        self.pbytes = pbytes
        self.name = name
        self.shadow = None  # PSUM: matmul accumulation state per element (see isa.nc_matmul)

    @property
    def nbytes(self) -> int:
        return self.data.size

    def typed(self, dtype: np.dtype) -> np.ndarray:
        view = _dtypes.storage_view(dtype)
        usable = self.data.size - self.data.size % view.itemsize
        return self.data[:usable].view(view)


def allocate(shape, dtype, buffer=sbuf, name: str = "", address=None, what: str = "nl.ndarray", fill=True):
    """A fresh tensor (``nl.ndarray``), counted against the running program's SBUF/PSUM."""
    from .tensor import NkiTensor

    program = current(what)
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(n) for n in shape)
    dtype = _dtypes.as_dtype(dtype)
    buffer = as_buffer(buffer)
    label = f"{name or 'tensor'} {shape} {_dtypes.name(dtype)}"
    if any(n <= 0 for n in shape) or not shape:
        fail(what, f"{label}: every dimension must be positive")
    if buffer in (sbuf, psum):
        partitions = shape[0]
        if partitions > 128:
            fail(what, f"{label}: partition dimension {partitions} exceeds maximum 128 (nl.tile_size.pmax); "
                 f"{buffer_label(buffer)} has 128 partitions")
        pbytes = math.prod(shape[1:]) * dtype.itemsize
        memory = program.sbuf if buffer is sbuf else program.psum
        ident = memory.allocate(partitions, pbytes, address, f"'{name}' {shape} {_dtypes.name(dtype)}" if name
                                else f"{shape} {_dtypes.name(dtype)}", what)
        data = np.empty(partitions * pbytes, dtype=np.uint8)
        storage = Storage(buffer, data, partitions, pbytes, name)
        weakref.finalize(storage, memory.release, ident)
    else:
        nbytes = math.prod(shape) * dtype.itemsize
        storage = None
        if buffer is shared_hbm and program.shared.nprograms > 1:
            # SPMD: every program's k-th shared_hbm allocation is the same tensor
            k = program.shared_allocs
            program.shared_allocs += 1
            with program.shared.lock:
                shared = program.shared.shared_hbm
                if k < len(shared):
                    storage = shared[k]
                    if storage.nbytes != nbytes:
                        fail(what, f"{label}: the programs of this launch allocate different shared_hbm tensors "
                             f"(allocation {k}: {storage.nbytes} vs {nbytes} bytes)")
                    fill = False
                else:  # filled here, under the lock: another program may write it as soon as it is listed
                    storage = Storage(buffer, np.empty(nbytes, dtype=np.uint8), 1, nbytes, name)
                    if fill:
                        storage.typed(dtype)[...] = _dtypes.sentinel(dtype)
                    shared.append(storage)
                fill = False
        if storage is None:
            storage = Storage(buffer, np.empty(nbytes, dtype=np.uint8), 1, nbytes, name)
    if fill:
        storage.typed(dtype)[...] = _dtypes.sentinel(dtype)
    return NkiTensor(shape, dtype, storage, name=name)


def from_numpy(array: np.ndarray, buffer=private_hbm, name: str = ""):
    """An HBM tensor over ``array``'s own memory (writes go to the array)."""
    from .tensor import NkiTensor

    dtype = _dtypes.as_dtype(array.dtype)
    data = array.reshape(-1).view(np.uint8) if array.size else np.empty(0, dtype=np.uint8)
    storage = Storage(as_buffer(buffer), data, 1, data.size, name)
    return NkiTensor(array.shape, dtype, storage, name=name)
