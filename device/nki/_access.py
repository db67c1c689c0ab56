"""Reading and writing a tensor view's elements, and what they touch (for the scheduler).

``NkiTensor`` inherits this: direct views are numpy strided views over the storage's bytes; indirect
ones (``scalar_offset`` / ``vector_offset``) are resolved to element indices when an instruction runs.
"""
from __future__ import annotations

import numpy as np

from . import _dtypes
from ._state import fail
from .memory import buffer_label


class TensorAccess:
    def _extent(self):
        """(first, last) element offsets this view touches (direct views)."""
        lo = hi = self._offset
        for n, s in zip(self._shape, self._strides):
            if n == 0:
                return self._offset, self._offset - 1
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return lo, hi

    def access_rect(self):
        """(storage id, first partition, end partition, first byte, end byte) this view may
        touch (bytes within a partition on chip), for the scheduler's dependencies."""
        storage = self._storage
        if self._indirect is not None:
            return (storage.id, 0, max(storage.partitions, 1), 0, storage.pbytes)
        lo, hi = self._extent()
        isz = self.itemsize
        if self.on_chip and storage.pbytes:
            pstride = storage.pbytes // isz
            p0 = lo // pstride
            p1 = hi // pstride + 1
            if p1 - p0 > 1:
                f0 = (self._offset % pstride) * isz
                free = sum((n - 1) * abs(s) for n, s in zip(self._shape[1:], self._strides[1:]))
                return (storage.id, p0, p1, f0, f0 + (free + 1) * isz)
            return (storage.id, p0, p1, (lo % pstride) * isz, (hi % pstride + 1) * isz)
        return (storage.id, 0, 1, lo * isz, (hi + 1) * isz)

    def _scalar_value(self, source) -> int:
        if hasattr(source, "value") and not isinstance(source, TensorAccess):
            return int(source.value)
        values = np.asarray(source.read()).reshape(-1)
        return int(values[0])

    def flat_index(self, what: str = "access", oob_skip: bool = False):
        """Element offsets (in ``dtype`` units) of every element, shape ``self.shape``; with
        ``oob_skip``, also a mask of the rows that are in bounds."""
        idx = np.full(self._shape, self._offset, dtype=np.int64)
        for d, (n, s) in enumerate(zip(self._shape, self._strides)):
            shape = [1] * self.ndim
            shape[d] = n
            if self._indirect is not None and self._indirect[0] == "vector" and d == 0:
                continue
            idx += (np.arange(n, dtype=np.int64) * s).reshape(shape)
        total = self._storage.data.size // self.itemsize
        mask = None
        if self._indirect is not None:
            kind, source, stride = self._indirect
            if kind == "scalar":
                idx += self._scalar_value(source) * stride
            else:
                rows = np.asarray(source.read()).reshape(source.shape[0], -1)[:, 0].astype(np.int64)
                if rows.shape[0] != self._shape[0]:
                    fail(what, f"vector_offset has {rows.shape[0]} indices for {self._shape[0]} rows")
                idx += (rows * stride).reshape([self._shape[0]] + [1] * (self.ndim - 1))
        if idx.size and (idx.min() < 0 or idx.max() >= total):
            if oob_skip:
                flat = idx.reshape(idx.shape[0], -1) if idx.ndim > 1 else idx.reshape(-1, 1)
                mask = ((flat >= 0) & (flat < total)).all(axis=1)
                idx = np.where((idx >= 0) & (idx < total), idx, 0)
            else:
                fail(what, f"out-of-bounds access: elements [{idx.min()}, {idx.max()}] of a {total}-element "
                     f"{buffer_label(self._buffer)} storage{self._storage_name()} (view shape {self._shape}, "
                     f"strides {self._strides}, offset {self._offset})")
        return (idx, mask) if oob_skip else idx

    def _storage_name(self):
        return f" '{self._storage.name}'" if self._storage.name else ""

    def _direct(self, what: str) -> np.ndarray:
        if self._storage is None:
            fail(what, "this tensor has no storage (a signature placeholder)")
        lo, hi = self._extent()
        isz = self.itemsize
        if lo < 0 or (hi + 1) * isz > self._storage.data.size:
            fail(what, f"out-of-bounds access: elements [{lo}, {hi}] of a "
                 f"{self._storage.data.size // isz}-element {buffer_label(self._buffer)} storage{self._storage_name()} "
                 f"(view shape {self._shape}, strides {self._strides}, offset {self._offset})")
        if self.on_chip and self.ndim > 1 and self.size:
            pstride = self._storage.pbytes // isz
            free_extent = sum((n - 1) * abs(s) for n, s in zip(self._shape[1:], self._strides[1:]))
            if (self._offset % pstride) + free_extent >= pstride and pstride:
                fail(what, f"view crosses a partition boundary: free extent {free_extent + 1} elements from element "
                     f"{self._offset % pstride} of a {pstride}-element partition")
        return np.ndarray(self._shape, dtype=_dtypes.storage_view(self._dtype), buffer=self._storage.data,
                          offset=self._offset * isz, strides=tuple(s * isz for s in self._strides))

    def read(self, what: str = "read") -> np.ndarray:
        """The values (a numpy array of this view's shape; may share memory)."""
        if self._indirect is not None:
            return self._storage.typed(self._dtype)[self.flat_index(what)]
        return self._direct(what)

    def write(self, values, what: str = "write", mask=None):
        """Store ``values`` (this view's shape or the same number of elements) into the view."""
        values = np.asarray(values)
        if values.shape != self._shape:
            if values.size == self.size:
                values = values.reshape(self._shape)
            else:
                values = np.broadcast_to(values, self._shape)
        values = _dtypes.cast(values, self._dtype)
        if self._indirect is not None or mask is not None:
            if mask is not None:
                idx, ok = mask
                self._storage.typed(self._dtype)[idx[ok]] = values[ok]
            else:
                self._storage.typed(self._dtype)[self.flat_index(what)] = values
            return
        self._direct(what)[...] = values

    def numpy(self) -> np.ndarray:
        """A copy of the values (host side, after a run)."""
        return np.array(self.read("numpy"), copy=True)
