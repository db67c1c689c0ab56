"""Device memory: one :class:`DeviceStorage` per allocation, and the allocator's books.

Entry points: :class:`DeviceStorage` and :data:`MEMORY`.

A storage plays a block of HBM. Its bytes live in a CPU tensor (``data``), which is
created lazily: the kernel that first writes the storage hands over its result tensor
("adopt"), so a functional op costs no extra copy; the host allocates the buffer itself
only when it needs to alias it before that (a view) or when nothing will write it
(``torch.empty``). Either way the device memory is accounted at allocation time, on the
host, as a CUDA caching allocator would: going over capacity raises
``torch.OutOfMemoryError`` there and then, and nothing already on the device is lost.

Views share their base's storage. A storage is freed when the last tensor and the last
queued kernel that use it are gone.
"""
from __future__ import annotations

import ctypes

import torch

from .. import _C as _native
from ..core.config import CONFIG

_ROUND = _native.ALLOCATION_GRANULARITY  # bytes an allocation rounds up to, as in CUDA's caching allocator


class MemoryBooks:
    """The allocator's books, kept in C++ (``device/csrc/cells.cpp``): a storage books its
    bytes when it is made and frees them when it is freed, on whichever thread drops it,
    with no Python code run."""

    __slots__ = ()
    _NAMES = ("allocated", "peak", "reserved", "allocations", "frees", "ooms", "live_blocks")

    def __getattr__(self, name: str) -> int:
        try:
            index = MemoryBooks._NAMES.index(name)
        except ValueError:
            raise AttributeError(name) from None
        return _native.books()[index]

    def __setattr__(self, name: str, value: int) -> None:
        """Only ``peak`` and ``reserved`` are set (``reset_peak_memory_stats``, ``empty_cache``)."""
        _, peak, reserved, *_ = _native.books()
        if name == "peak":
            _native.set_books(value, reserved)
        elif name == "reserved":
            _native.set_books(peak, value)
        else:
            raise AttributeError(f"MEMORY.{name} is counted by the allocator, not set")


MEMORY = MemoryBooks()

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def _libc_malloc_function(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None


def keep_freed_memory() -> bool:
    """The host thread's part of the device's memory pool, as CUDA's caching allocator keeps
    freed blocks for reuse (the worker's kernels allocate from a pool of their own:
    ``device/csrc/host_pool.cpp``).

    The simulated device's memory is host memory from the C allocator. By default glibc
    maps each block over 128 KiB afresh and returns freed memory to the OS, so every
    activation-sized kernel output costs page faults (measured: half of the system time of
    a GPT training step). Called when the device starts, this keeps freed memory in the
    heap for the next allocation; ``torch.neuron.empty_cache()`` returns it to the OS.
    Returns False where the C library is not glibc."""
    mallopt = _libc_malloc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


def release_freed_memory() -> None:
    """Return the pools' free memory to the OS (``torch.neuron.empty_cache``): the worker's
    cached blocks, then the heap's free memory."""
    _native.release_host_pool()
    trim = _libc_malloc_function("malloc_trim")
    if trim is not None:
        trim(0)


def rounded_nbytes(nbytes: int) -> int:
    """What an allocation of ``nbytes`` books: rounded up to the allocation granularity."""
    return -(-nbytes // _ROUND) * _ROUND


def storage_nbytes(shape, stride, itemsize: int) -> int:
    """Bytes a tensor of this shape and stride spans from its first element."""
    span = 1
    for size, step in zip(shape, stride):
        if size == 0:
            return 0
        span += (size - 1) * step
    return span * itemsize


def _size(nbytes: int) -> str:
    """``1.50 GiB``, or ``4.00 MiB`` below a GiB (as CUDA's messages)."""
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.2f} MiB"


def _out_of_memory(nbytes: int) -> torch.OutOfMemoryError:
    capacity = CONFIG.hbm_bytes
    from ..core.errors import users_error

    return users_error(torch.OutOfMemoryError(
        f"neuron: out of device memory. Tried to allocate {_size(nbytes)}; the device "
        f"holds {_size(capacity)}, of which {_size(MEMORY.allocated)} are "
        f"allocated in {MEMORY.live_blocks} blocks (peak {_size(MEMORY.peak)}). "
        "Nothing already on the device was lost. Set NEURON_SIM_HBM_GB to simulate a larger "
        "device, or free tensors you no longer need."
    ))


_new_storage = _native.new_storage


class DeviceStorage(_native.StorageBase):
    """One device allocation. Its bytes are the C side's (``device/csrc/cells.cpp``):
    ``data`` (a CPU tensor over them, or None until something writes them),
    ``materialize()``, ``adopt(result)`` and ``poison`` (the KernelFailure that left it
    without valid data, or None), so the device worker reaches them without the GIL."""

    # nbytes (booked, freed by the C side when the storage is), shape, stride, dtype (the
    # layout it was made for) and alive (is its PrivateUse1 storage still referenced by
    # anything: a tensor, a view, a tensor autograd saved, an optimizer's state? The C++
    # side clears it when the storage is freed, device/csrc/memory.cpp: an adaptive window
    # need not write back a value it made whose storage nothing references any more) are
    # the C side's fields.
    __slots__ = ("__weakref__",)

    def __new__(cls, shape, stride, dtype, nbytes: int, data=None) -> "DeviceStorage":
        """A storage of ``nbytes`` (rounded up to the allocation granularity) for the layout
        (shape, stride, dtype), booked and made in one C call (``_C.new_storage``); ``data``:
        its bytes, when they exist already."""
        storage = _new_storage(cls, shape, stride, dtype, nbytes, CONFIG.hbm_bytes)
        if storage is None:
            raise _out_of_memory(rounded_nbytes(nbytes))
        if data is not None:
            storage.data = data
        return storage

    @classmethod
    def fresh_slots(cls, layouts, slots: int):
        """What a compiled graph's replay makes at each call, read once (``_C.FreshSlots``):
        ``layouts`` are ``(slot, shape, stride, dtype, bytes rounded up to the allocation
        granularity, escapes)`` each, in a table of ``slots`` entries. Its ``allocate(table,
        capacity)`` books them at once, as making them one after the other books them (a
        replay makes all of a call's storages before it issues anything): the escaping ones
        (an output's) as storages, put into ``table`` at their slots; the others, the call's
        intermediates, as the C side's cells only, by slot in the ``FreshCells`` returned,
        each freeing its own bytes (no Python object is made for them unless Python needs
        one: ``FreshCells.wrap(table)``); None, with none of them booked, when they do not
        all fit."""
        return _native.FreshSlots(cls, list(layouts), slots)

    @classmethod
    def of_bytes(cls, nbytes: int) -> "DeviceStorage":
        """The Python side of a storage ATen allocated on the device (``torch.UntypedStorage(n,
        device="neuron")``), made when Python first meets it: ``nbytes`` of bytes."""
        return cls((nbytes,), (1,), torch.uint8, nbytes)

    def resize_bytes(self, nbytes: int) -> None:
        """``storage.resize_(nbytes)``: the first ``nbytes`` bytes are kept (the caller has
        waited for the kernels writing them). The bytes become one uint8 buffer; tensors
        over the storage read them through their own dtype (``ReinterpretRef``)."""
        rounded = rounded_nbytes(nbytes)
        if not _native.book(rounded - (self.nbytes or 0), 0, CONFIG.hbm_bytes):  # the change, no new block
            raise _out_of_memory(rounded)
        self.nbytes = rounded
        old = self.data
        data = torch.empty(nbytes, dtype=torch.uint8)
        if old is not None:
            kept = min(nbytes, old.untyped_storage().nbytes())
            if kept:
                data[:kept].copy_(torch.empty(0, dtype=torch.uint8).set_(old.untyped_storage())[:kept])
        self.shape, self.stride, self.dtype = (nbytes,), (1,), torch.uint8
        self._layout(self.shape, self.stride, self.dtype)
        self.data = data


class ViewRef:
    """A tensor's place in a storage: resolved to a CPU view when a kernel runs."""

    __slots__ = ("storage", "shape", "stride", "offset")

    def __init__(self, storage: DeviceStorage, shape, stride, offset: int) -> None:
        self.storage = storage
        self.shape = shape
        self.stride = stride
        self.offset = offset

    def resolve(self, base: torch.Tensor) -> torch.Tensor:
        return base.as_strided(self.shape, self.stride, self.offset)

    def __repr__(self) -> str:
        return f"ViewRef({self.shape}, {self.stride}, offset={self.offset})"


class ReinterpretRef:
    """A tensor whose view of its storage a ``ViewRef`` cannot describe: another dtype over
    the same bytes (``view(torch.int32)``, ``view_as_real``, a resized storage), or a
    conjugate or negative bit. Resolved through the storage's bytes."""

    __slots__ = ("storage", "shape", "stride", "offset", "dtype", "conj", "neg")

    def __init__(self, storage: DeviceStorage, shape, stride, offset: int, dtype, conj: bool, neg: bool) -> None:
        self.storage = storage
        self.shape = shape
        self.stride = stride
        self.offset = offset
        self.dtype = dtype
        self.conj = conj
        self.neg = neg

    def resolve(self, base: torch.Tensor) -> torch.Tensor:
        if self.dtype is base.dtype:
            view = base.as_strided(self.shape, self.stride, self.offset)
        else:
            view = torch.empty(0, dtype=self.dtype).set_(base.untyped_storage(), self.offset, self.shape, self.stride)
        if self.conj:
            view = torch._conj(view) if not view.is_conj() else view
        if self.neg:
            view = torch._neg_view(view) if not view.is_neg() else view
        return view

    def __repr__(self) -> str:
        return f"ReinterpretRef({self.shape}, {self.stride}, offset={self.offset}, {self.dtype})"
