"""Memory regions, storages and allocation.

A storage is a byte buffer in SBUF, PSUM or HBM. On-chip storages are partition-major: partition
``p`` holds bytes ``[p * pbytes, (p + 1) * pbytes)``. ``allocate`` (``nl.ndarray``) counts a new
on-chip storage against the running program's SBUF/PSUM (``_state.OnChipMemory``) until the
storage is garbage; ``from_numpy`` wraps a caller's array as an HBM tensor over its own memory.
"""
from __future__ import annotations

import enum

import numpy as np

from . import _dtypes
from ._state import maybe_current


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
