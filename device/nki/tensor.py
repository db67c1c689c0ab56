"""``NkiTensor``: storage plus a strided view, as the NKI Language Guide defines it.

A tensor is a storage (a byte buffer in SBUF, PSUM or HBM) and a view on it: ``shape``,
``strides`` and ``offset`` in elements of ``dtype``. The element at index ``(i0, ..., in)`` sits at
``offset + sum(strides[k] * ik)``. On-chip storages (SBUF, PSUM) are partition-major: partition
``p`` holds bytes ``[p * pbytes, (p + 1) * pbytes)``, so the partition stride of a fresh tensor
is its free size. Views (indexing, ``slice``, ``reshape``, ``permute``, ``broadcast``, ``ap`` ...)
share the storage. ``ap(..., scalar_offset=, vector_offset=)`` views are indirect: their
addresses depend on an index read when an instruction uses them.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from . import _dtypes
from ._access import TensorAccess
from ._state import NkiValidationError, current, fail, user_frame, where  # noqa: F401  (re-exported)
from .memory import (MemoryRegion, Storage, as_buffer, buffer_label, hbm,  # noqa: F401
                     is_hbm, is_on_chip, is_psum, is_sbuf, private_hbm, psum, sbuf, shared_hbm)


def _is_classvar(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "ClassVar" in text


class NKIObject:
    """Base class for NKI kernel dataclasses and configuration objects (``nl.NKIObject``).

    In NKI "all classes are similar to Python data classes": the compiler gives a class an
    initializer taking its attributes (NKI Language Guide, "Class Support"), annotated or not. So
    that ``@dataclass`` on an ``NKIObject`` subclass does the same in Python, plain class attributes
    (``section_idx = None``) are given annotations, and annotated attributes without a value get the
    default ``None``, when the subclass is created, before the decorator runs; without ``@dataclass``, ``NKIObject(**kwargs)`` sets attributes."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        annotations = cls.__dict__.get("__annotations__")
        if annotations is None:
            annotations = {}
            cls.__annotations__ = annotations
        for key, value in list(cls.__dict__.items()):
            if key.startswith("__") or key in annotations or callable(value) or isinstance(
                    value, (property, classmethod, staticmethod, list, dict, set)):
                continue
            annotations[key] = "typing.Any"
        for key in annotations:  # "x : int" initialises as x=None (the guide's generated __init__)
            if key not in cls.__dict__ and not key.startswith("__") and not _is_classvar(annotations[key]):
                setattr(cls, key, None)

    def __init__(self, **kwargs):
        for key, value in kwargs.items():
            setattr(self, key, value)


class DynamicSlice:
    """``nl.ds(start, size)``: a slice of ``size`` elements from ``start``."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start = start
        self.size = size

    def as_slice(self):
        return slice(int(self.start), int(self.start) + int(self.size))

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


def ds(start, size):
    """A dynamic slice: ``t[nl.ds(i, n)]`` is ``t[i:i + n]``."""
    if not isinstance(start, (int, np.integer)):
        return DynamicSlice(start, size)
    return slice(int(start), int(start) + int(size))


def _c_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _nocopy_reshape(shape, strides, new_shape):
    """New strides for ``new_shape`` over the same elements without copying, or None."""
    if math.prod(shape) == 0:
        return _c_strides(new_shape)
    dummy = np.lib.stride_tricks.as_strided(np.zeros(1, dtype=np.uint8), shape=shape, strides=strides)
    try:
        return np.reshape(dummy, new_shape, copy=False).strides
    except ValueError:
        return None


class NkiTensor(TensorAccess, NKIObject):
    """NKI tensor with shape-based view operations (``nki.language.NkiTensor``)."""

    def __init__(self, shape, dtype, storage=None, buffer=sbuf, name: str = "", *, strides=None, offset: int = 0,
                 indirect=None):
        self._shape = tuple(int(n) for n in shape)
        self._dtype = _dtypes.as_dtype(dtype)
        self._storage = storage
        self._buffer = as_buffer(buffer) if storage is None else storage.buffer
        self.name = name or (storage.name if storage is not None else "")
        self._strides = tuple(int(s) for s in strides) if strides is not None else _c_strides(self._shape)
        self._offset = int(offset)
        self._indirect = indirect  # None, ("scalar", source, stride) or ("vector", source, stride)

    # -- attributes ------------------------------------------------------------------------
    shape = property(lambda self: self._shape)
    strides = property(lambda self: self._strides)
    offset = property(lambda self: self._offset)
    dtype = property(lambda self: self._dtype)
    buffer = property(lambda self: self._buffer)
    storage = property(lambda self: self._storage)
    ndim = property(lambda self: len(self._shape))
    size = property(lambda self: math.prod(self._shape))
    itemsize = property(lambda self: self._dtype.itemsize)

    @property
    def on_chip(self) -> bool:
        return self._buffer in (sbuf, psum)

    @property
    def partition_stride(self) -> int:
        """Elements of ``dtype`` per partition of the storage (on chip)."""
        return self._storage.pbytes // self.itemsize

    def __repr__(self):
        name = f", name={self.name!r}" if self.name else ""
        return f"NkiTensor(shape={self._shape}, dtype={_dtypes.name(self._dtype)}, buffer={self._buffer!r}{name})"

    def __len__(self):
        return self._shape[0]

    def __bool__(self):
        return True

    def __iter__(self):
        raise TypeError("an NkiTensor is on-device memory; iterate over range(t.shape[0]) and index it")

    def _view(self, shape, strides, offset, dtype=None, indirect=None, storage=None):
        t = NkiTensor.__new__(NkiTensor)
        t._shape = tuple(int(n) for n in shape)
        t._dtype = self._dtype if dtype is None else dtype
        t._storage = self._storage if storage is None else storage
        t._buffer = self._buffer
        t.name = self.name
        t._strides = tuple(int(s) for s in strides)
        t._offset = int(offset)
        t._indirect = self._indirect if indirect is None else indirect
        return t

    def _check(self, condition, what, message):
        if not condition:
            fail(what, message)

    # -- queries -------------------------------------------------------------------------------
    def is_contiguous(self) -> bool:
        dims = range(1, self.ndim) if self.on_chip else range(self.ndim)
        expected = 1
        for d in reversed(list(dims)):
            if self._shape[d] != 1 and self._strides[d] != expected:
                return False
            expected *= self._shape[d]
        return True

    def get_pattern(self):
        return [[s, n] for s, n in zip(self._strides, self._shape)]

    def is_indirect(self) -> bool:
        return self._indirect is not None

    # -- indexing ------------------------------------------------------------------------------
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        explicit = sum(1 for k in key if k is not Ellipsis and k is not None)
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - explicit) + key[at + 1:]
        if len(key) > self.ndim:
            fail("NkiTensor.__getitem__", f"{len(key)} indices for a {self.ndim}-D tensor of shape {self._shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, kept, offset = [], [], [], self._offset
        dropped = None
        for d, (k, n, s) in enumerate(zip(key, self._shape, self._strides)):
            if isinstance(k, DynamicSlice):
                k = k.as_slice()
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step <= 0:
                    fail("NkiTensor.__getitem__", f"slice step must be positive, got {step}")
                count = len(range(start, stop, step))
                offset += start * s if count else 0
                shape.append(count)
                strides.append(s * step)
                kept.append(d)
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                k = int(k)
                if k < 0:
                    k += n
                if not 0 <= k < n:
                    fail("NkiTensor.__getitem__", f"index {k} out of range for dimension {d} of size {n} "
                         f"(shape {self._shape})")
                offset += k * s
                if self.on_chip and d == 0:
                    shape.append(1)
                    strides.append(s)
                    kept.append(d)
                else:
                    dropped = (d, s)
            elif isinstance(k, NkiTensor):
                if any(not (isinstance(o, slice) and o == slice(None)) for i, o in enumerate(key) if i != d):
                    fail("NkiTensor.__getitem__", "a tensor index must be the only non-':' index (use .select)")
                return self.select(d, k)
            else:
                fail("NkiTensor.__getitem__", f"unsupported index {k!r} (ints, slices, ..., nl.ds(start, size))")
        minimum = 2 if self.on_chip else 1
        if len(shape) < minimum and dropped is not None:
            d, s = dropped
            at = sum(1 for x in kept if x < d)
            shape.insert(at, 1)
            strides.insert(at, s)
        return self._view(shape, strides, offset)

    def __setitem__(self, key, value):
        fail("NkiTensor.__setitem__", "tensors are written by instructions (nisa.tensor_copy, nisa.dma_copy, ...), "
             "not by assignment")

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> "NkiTensor":
        dim = self._dim(dim, "slice")
        self._check(0 <= start < end <= self._shape[dim] and step >= 1, "NkiTensor.slice",
                    f"slice({dim}, {start}, {end}, {step}) outside dimension {dim} of size {self._shape[dim]}")
        if self._indirect is not None and self._indirect[0] == "vector" and dim == 0:
            fail("NkiTensor.slice", "cannot slice the indirect dimension of a vector_select view")
        shape, strides = list(self._shape), list(self._strides)
        shape[dim] = len(range(start, end, step))
        strides[dim] *= step
        return self._view(shape, strides, self._offset + start * self._strides[dim])

    def select(self, dim: int, index) -> "NkiTensor":
        dim = self._dim(dim, "select")
        if isinstance(index, (int, np.integer)):
            self._check(0 <= index < self._shape[dim], "NkiTensor.select",
                        f"index {index} outside dimension {dim} of size {self._shape[dim]}")
            shape = self._shape[:dim] + self._shape[dim + 1:]
            strides = self._strides[:dim] + self._strides[dim + 1:]
            return self._view(shape, strides, self._offset + int(index) * self._strides[dim])
        self._check(self._indirect is None, "NkiTensor.select", "only one dynamic select per tensor")
        self._check(not (self.on_chip and dim == 0), "NkiTensor.select",
                    "a dynamic select cannot target the partition dimension of an on-chip tensor")
        shape = self._shape[:dim] + self._shape[dim + 1:]
        strides = self._strides[:dim] + self._strides[dim + 1:]
        return self._view(shape, strides, self._offset, indirect=("scalar", index, self._strides[dim]))

    def vector_select(self, dim: int, vector_offset: "NkiTensor") -> "NkiTensor":
        self._check(dim == 0, "NkiTensor.vector_select", "vector_select indirects dimension 0 only")
        self._check(is_hbm(self._buffer), "NkiTensor.vector_select", "vector_select is for HBM tensors")
        self._check(self._indirect is None, "NkiTensor.vector_select", "only one dynamic select per tensor")
        shape = (vector_offset.shape[0],) + self._shape[1:]
        return self._view(shape, self._strides, self._offset, indirect=("vector", vector_offset, self._strides[0]))

    def _dim(self, dim, what):
        if dim < 0:
            dim += self.ndim
        self._check(0 <= dim < self.ndim, f"NkiTensor.{what}", f"dimension {dim} out of range for shape {self._shape}")
        return dim

    # -- shape views -----------------------------------------------------------------------------
    def permute(self, dims) -> "NkiTensor":
        dims = tuple(dims)
        self._check(sorted(dims) == list(range(self.ndim)), "NkiTensor.permute",
                    f"{dims} is not a permutation of the {self.ndim} dimensions")
        self._check(not (self.on_chip and dims[0] != 0), "NkiTensor.permute",
                    "the partition dimension of an on-chip tensor stays first (dims[0] must be 0)")
        return self._view([self._shape[d] for d in dims], [self._strides[d] for d in dims], self._offset)

    def broadcast(self, dim: int, size: int) -> "NkiTensor":
        dim = self._dim(dim, "broadcast")
        self._check(self._shape[dim] == 1, "NkiTensor.broadcast",
                    f"only a size-1 dimension broadcasts; dimension {dim} has size {self._shape[dim]}")
        self._check(not (self.on_chip and dim == 0), "NkiTensor.broadcast",
                    "the partition dimension of an on-chip tensor cannot be broadcast (that moves data across "
                    "partitions)")
        shape, strides = list(self._shape), list(self._strides)
        shape[dim], strides[dim] = int(size), 0
        return self._view(shape, strides, self._offset)

    def expand_dim(self, dim: int) -> "NkiTensor":
        if dim < 0:
            dim += self.ndim + 1
        self._check(0 <= dim <= self.ndim and not (self.on_chip and dim == 0), "NkiTensor.expand_dim",
                    f"cannot insert a dimension at {dim} (on chip, the partition dimension stays first)")
        shape, strides = list(self._shape), list(self._strides)
        shape.insert(dim, 1)
        strides.insert(dim, strides[dim] * self._shape[dim] if dim < self.ndim else 1)
        return self._view(shape, strides, self._offset)

    def squeeze_dim(self, dim: int) -> "NkiTensor":
        dim = self._dim(dim, "squeeze_dim")
        self._check(self._shape[dim] == 1, "NkiTensor.squeeze_dim", f"dimension {dim} has size {self._shape[dim]}, not 1")
        self._check(not (self.on_chip and dim == 0), "NkiTensor.squeeze_dim", "the partition dimension cannot be removed")
        return self._view(self._shape[:dim] + self._shape[dim + 1:], self._strides[:dim] + self._strides[dim + 1:],
                          self._offset)

    def reshape_dim(self, dim: int, shape) -> "NkiTensor":
        dim = self._dim(dim, "reshape_dim")
        shape = list(shape)
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape[shape.index(-1)] = self._shape[dim] // max(known, 1)
        self._check(math.prod(shape) == self._shape[dim], "NkiTensor.reshape_dim",
                    f"{tuple(shape)} does not split dimension {dim} of size {self._shape[dim]}")
        self._check(not (self.on_chip and dim == 0 and len(shape) > 1 and shape[0] != self._shape[0]),
                    "NkiTensor.reshape_dim", "the partition dimension of an on-chip tensor cannot be split")
        strides = list(_c_strides(shape))
        strides = [s * self._strides[dim] for s in strides]
        return self._view(self._shape[:dim] + tuple(shape) + self._shape[dim + 1:],
                          self._strides[:dim] + tuple(strides) + self._strides[dim + 1:], self._offset)

    def flatten_dims(self, start_dim: int, end_dim: int) -> "NkiTensor":
        start_dim, end_dim = self._dim(start_dim, "flatten_dims"), self._dim(end_dim, "flatten_dims")
        self._check(not (self.on_chip and start_dim == 0), "NkiTensor.flatten_dims",
                    "the partition dimension of an on-chip tensor cannot be merged")
        for d in range(start_dim, end_dim):
            self._check(self._shape[d + 1] == 1 or self._shape[d] == 1
                        or self._strides[d] == self._strides[d + 1] * self._shape[d + 1],
                        "NkiTensor.flatten_dims", f"dimensions {start_dim}..{end_dim} are not contiguous "
                        f"(shape {self._shape}, strides {self._strides})")
        merged = math.prod(self._shape[start_dim:end_dim + 1])
        inner = [s for n, s in zip(self._shape[start_dim:end_dim + 1], self._strides[start_dim:end_dim + 1]) if n != 1]
        return self._view(self._shape[:start_dim] + (merged,) + self._shape[end_dim + 1:],
                          self._strides[:start_dim] + ((inner[-1] if inner else 1),) + self._strides[end_dim + 1:],
                          self._offset)

    def reshape(self, shape, *more) -> "NkiTensor":
        if more or isinstance(shape, (int, np.integer)):
            shape = (shape,) + more
        shape = [int(n) for n in shape]
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape[shape.index(-1)] = self.size // max(known, 1)
        self._check(math.prod(shape) == self.size, "NkiTensor.reshape",
                    f"cannot reshape {self._shape} ({self.size} elements) to {tuple(shape)}")
        if self.on_chip:
            self._check(shape[0] == self._shape[0], "NkiTensor.reshape",
                        f"reshape {self._shape} -> {tuple(shape)} changes the partition dimension of an on-chip "
                        "tensor (moving data across partitions needs an instruction)")
            free = _nocopy_reshape(self._shape[1:], self._strides[1:], shape[1:])
            strides = None if free is None else (self._strides[0],) + tuple(free)
        else:
            strides = _nocopy_reshape(self._shape, self._strides, shape)
        self._check(strides is not None, "NkiTensor.reshape",
                    f"the layout of this view (shape {self._shape}, strides {self._strides}) cannot be reshaped "
                    f"to {tuple(shape)} without a copy")
        return self._view(shape, strides, self._offset)

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None) -> "NkiTensor":
        fixed = dict(fixed_sizes or {})
        self._check(len(src_pattern) == self.ndim, "NkiTensor.rearrange",
                    f"pattern {src_pattern} has {len(src_pattern)} groups for a {self.ndim}-D tensor")
        t, sizes, names = self, {}, []
        dim = 0
        for group, n in zip(src_pattern, self._shape):
            group = (group,) if isinstance(group, str) else tuple(group)
            if len(group) > 1:
                unknown = [g for g in group if g not in fixed]
                known = math.prod(fixed[g] for g in group if g in fixed)
                split = [fixed.get(g, n // known if len(unknown) == 1 else -1) for g in group]
                t = t.reshape_dim(dim, split)
            for g, m in zip(group, t.shape[dim:dim + len(group)]):
                sizes[g] = m
                names.append(g)
            dim += len(group)
        flat = [g for group in dst_pattern for g in ((group,) if isinstance(group, str) else group)]
        t = t.permute([names.index(g) for g in flat])
        dim = 0
        for group in dst_pattern:
            group = (group,) if isinstance(group, str) else tuple(group)
            if len(group) > 1:
                t = t.flatten_dims(dim, dim + len(group) - 1)
            dim += 1
        return t

    def view(self, dtype) -> "NkiTensor":
        return self._reinterpret(dtype, "view")

    def reinterpret_cast(self, dtype) -> "NkiTensor":
        return self._reinterpret(dtype, "reinterpret_cast")

    def _reinterpret(self, dtype, what):
        dtype = _dtypes.as_dtype(dtype)
        old, new = self.itemsize, dtype.itemsize
        if old == new:
            return self._view(self._shape, self._strides, self._offset, dtype=dtype)
        self._check(self._indirect is None, f"NkiTensor.{what}", "not supported after a dynamic/vector select")
        self._check(self._strides[-1] == 1, f"NkiTensor.{what}", "the last dimension must be contiguous")
        if new > old:
            r = new // old
            self._check(self._shape[-1] % r == 0 and self._offset % r == 0 and all(s % r == 0 for s in self._strides[:-1]),
                        f"NkiTensor.{what}", f"last dimension {self._shape[-1]} does not hold whole {_dtypes.name(dtype)} elements")
            return self._view(self._shape[:-1] + (self._shape[-1] // r,), tuple(s // r for s in self._strides[:-1]) + (1,),
                              self._offset // r, dtype=dtype)
        r = old // new
        return self._view(self._shape[:-1] + (self._shape[-1] * r,), tuple(s * r for s in self._strides[:-1]) + (1,),
                          self._offset * r, dtype=dtype)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim: int = 0, dtype=None):
        """A raw access pattern ``[[stride, count], ...]`` on the storage (not composable with the
        view, except that ``offset`` adds to the view's offset). Pattern and offset are in elements
        of ``dtype`` (default: this tensor's)."""
        dtype = self._dtype if dtype is None else _dtypes.as_dtype(dtype)
        pattern = [(int(s), int(n)) for s, n in pattern]
        base = self._offset * self.itemsize
        if base % dtype.itemsize:
            fail("NkiTensor.ap", f"the view's offset {self._offset} is not a whole number of {_dtypes.name(dtype)} elements")
        new_offset = base // dtype.itemsize + (int(offset) if offset is not None else 0)
        if self.on_chip and pattern and vector_offset is None:
            pstride = self._storage.pbytes // dtype.itemsize
            if pattern[0][0] != pstride and pattern[0][1] > 1:
                fail("NkiTensor.ap", f"partition stride {pattern[0][0]} must equal the storage's free size "
                     f"{pstride} elements (every partition performs the same access)")
        indirect = None
        if scalar_offset is not None and vector_offset is not None:
            fail("NkiTensor.ap", "scalar_offset and vector_offset are mutually exclusive")
        if scalar_offset is not None or vector_offset is not None:
            if self._indirect is not None:
                fail("NkiTensor.ap", "this view is already indirect")
            stride = self._strides[indirect_dim] * self.itemsize // dtype.itemsize if self.ndim else 1
            indirect = ("scalar", scalar_offset, stride) if scalar_offset is not None else ("vector", vector_offset, stride)
        t = self._view([n for _, n in pattern], [s for s, _ in pattern], new_offset, dtype=dtype)
        t._indirect = indirect
        return t

    def indirect(self, index, num_elem=None):
        fail("NkiTensor.indirect", "tensor indirection is available on NeuronCore-v4 (Trn3) and later; the simulator "
             "models NeuronCore-v3 (Trn2)")

def allocate(shape, dtype, buffer=sbuf, name: str = "", address=None, what: str = "nl.ndarray", fill=True):
    """A fresh tensor (``nl.ndarray``), counted against the running program's SBUF/PSUM."""
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
    dtype = _dtypes.as_dtype(array.dtype)
    data = array.reshape(-1).view(np.uint8) if array.size else np.empty(0, dtype=np.uint8)
    storage = Storage(as_buffer(buffer), data, 1, data.size, name)
    return NkiTensor(array.shape, dtype, storage, name=name)


__all__ = ["NKIObject", "NkiTensor", "MemoryRegion", "NkiValidationError", "Storage", "DynamicSlice", "ds",
           "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "is_hbm", "is_on_chip", "is_psum", "is_sbuf",
           "allocate", "from_numpy", "user_frame", "where"]
