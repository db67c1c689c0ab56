"""Data movement: DMA (copy, transpose, compute) and on-chip copies and fills."""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from .._ops import as_op
from ..tensor import NkiTensor, private_hbm, psum, sbuf, shared_hbm
from . import constants
from .constants import dge_mode, engine, oob_mode
from ._call import _Call


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """``dst = src`` by the DMA engines, between HBM and SBUF, casting through float32."""
    c = _Call("dma_copy")
    c.tile("dst", dst, (sbuf, private_hbm, shared_hbm), write=True,
           why="DMA engines move data between HBM and SBUF; PSUM is read by the compute engines")
    c.tile("src", src, (sbuf, private_hbm, shared_hbm),
           why="DMA engines move data between HBM and SBUF; PSUM is read by the compute engines")
    if dst.size != src.size:
        c.fail(f"dst has {dst.size} elements {dst.shape} but src has {src.size} {src.shape}")
    skip = oob_mode is constants.oob_mode.skip
    if src.is_indirect():
        if skip:
            idx, ok = src.flat_index("dma_copy", oob_skip=True)
            values = src.storage.typed(src.dtype)[idx]
            if ok is not None:
                keep = dst.read("dma_copy").reshape(values.shape) if dst.size == values.size else None
                values = np.where(ok.reshape([-1] + [1] * (values.ndim - 1)), values,
                                  _dtypes.cast(keep, src.dtype) if keep is not None else values)
        else:
            values = src.read("dma_copy")
    else:
        values = src.read("dma_copy")
    if src.dtype != dst.dtype:
        values = _dtypes.to_f32(values) if not _dtypes.is_int(src.dtype) else values
    values = np.asarray(values).reshape(-1)
    if dst.is_indirect() and skip:
        idx, ok = dst.flat_index("dma_copy", oob_skip=True)
        vals = _dtypes.cast(values.reshape(dst.shape), dst.dtype)
        if ok is None:
            dst.storage.typed(dst.dtype)[idx] = vals
        else:
            dst.storage.typed(dst.dtype)[idx[ok]] = vals[ok]
    else:
        dst.write(values.reshape(dst.shape), "dma_copy")
    side = dst if dst.on_chip else src
    rows = side.shape[0] if side.on_chip else (dst.shape[0] if dst.ndim else 1)
    return c.record("DMA", nbytes=dst.size * dst.itemsize, rows=min(rows, 128), elements=dst.size)


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """Transpose by the DMA engines: 2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0)."""
    c = _Call("dma_transpose")
    c.tile("dst", dst, (sbuf,), write=True)
    c.tile("src", src, (sbuf, private_hbm, shared_hbm))
    default = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    if src.ndim not in default:
        c.fail(f"src must be 2-D, 3-D or 4-D, got shape {src.shape}")
    axes = tuple(axes) if axes is not None else default[src.ndim]
    if axes != default[src.ndim]:
        c.fail(f"axes {axes} not supported for a {src.ndim}-D src (supported: {default[src.ndim]})")
    if src.dtype != dst.dtype:
        c.fail(f"src.dtype {_dtypes.name(src.dtype)} != dst.dtype {_dtypes.name(dst.dtype)}")
    values = np.transpose(np.asarray(src.read("dma_transpose")), axes)
    if values.size != dst.size:
        c.fail(f"the transposed src {values.shape} has {values.size} elements; dst {dst.shape} has {dst.size}")
    dst.write(values.reshape(dst.shape), "dma_transpose")
    eff = "DMA_TRANSPOSE_EFFICIENCY_SBUF" if src.buffer is sbuf else "DMA_TRANSPOSE_EFFICIENCY_HBM"
    from .. import cost

    return c.record("DMA", nbytes=dst.size * dst.itemsize, rows=dst.shape[0], efficiency=getattr(cost, eff),
                    elements=dst.size)


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy ``src`` to ``dst`` on chip (Vector, Scalar or GpSimd engine)."""
    c = _Call("tensor_copy")
    c.tile("dst", dst, write=True)
    c.tile("src", src, why="compute engines read SBUF/PSUM only; use nisa.dma_copy for HBM")
    c.same_pf("dst", dst, "src", src)
    eng = c.engine(engine, "VectorE", ("VectorE", "ScalarE", "GpSimd"))
    c.check_gpsimd_psum(eng)
    if src.dtype == dst.dtype and eng != "ScalarE":
        values = c.read(src, f32=False)  # bit-accurate copy
    else:
        values = c.read(src, f32=not _dtypes.is_int(src.dtype) or _dtypes.is_float(dst.dtype))
    c.write(dst, values)
    return c.record(eng)


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with a compile-time constant (Vector or GpSimd engine)."""
    c = _Call("memset")
    c.tile("dst", dst, write=True)
    eng = c.engine(engine, "VectorE", ("VectorE", "GpSimd"))
    c.check_gpsimd_psum(eng)
    if isinstance(value, NkiTensor):
        c.fail("value must be a compile-time constant")
    if dst.dtype in _dtypes.PACKED:
        if value != 0:
            c.fail("packed x4 types can only be memset to 0")
        dst._direct("memset")[...] = np.zeros((), dtype=dst.dtype)
    else:
        exact_int = isinstance(value, (int, np.integer, bool)) or (not _dtypes.is_float(dst.dtype)
                                                                   and float(value).is_integer())
        c.write(dst, np.full(dst.shape, value, dtype=np.int64 if exact_int else np.float64))
    return c.record(eng, zero=(value == 0))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """``dst = src`` where ``predicate`` is nonzero (or zero with ``reverse_pred``); elsewhere unchanged."""
    c = _Call("tensor_copy_predicated")
    c.tile("dst", dst, write=True)
    c.tile("predicate", predicate)
    c.same_pf("dst", dst, "predicate", predicate)
    if not _dtypes.is_int(predicate.dtype):
        c.fail(f"predicate must be uint8, uint16 or uint32, got {_dtypes.name(predicate.dtype)}")
    p = dst.shape[0]
    if isinstance(src, NkiTensor):
        c.tile("src", src)
        c.same_pf("dst", dst, "src", src)
        if src.buffer is psum and predicate.buffer is psum:
            c.fail("src and predicate cannot both be in PSUM")
        if src.dtype != dst.dtype:
            c.fail(f"src and dst must share a dtype ({_dtypes.name(src.dtype)} vs {_dtypes.name(dst.dtype)})")
        values = c.read(src, f32=False)
    else:
        values = np.full((p, c.pf(dst)[1]), src, dtype=np.float64)
    pred = c.read(predicate, f32=False) != 0
    if reverse_pred:
        pred = ~pred
    out = c.read(dst, f32=False).copy()
    out = np.where(pred, _dtypes.cast(values, dst.dtype), out)
    c.write(dst, out)
    return c.record("VectorE")


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None):
    """``dst = sum(srcs[i] * scales[i])`` computed by the DMA engines (float32)."""
    c = _Call("dma_compute")
    c.tile("dst", dst, (sbuf, private_hbm, shared_hbm), write=True)
    rop = as_op(reduce_op, c.name, "reduce_op")
    if rop.name != "add":
        c.fail("only nl.add is supported for reduce_op")
    scales = [1.0] * len(srcs) if scales is None else list(scales)
    if any(float(s) != 1.0 for s in scales):
        c.fail("all scales must be 1.0")
    total = None
    for i, s in enumerate(srcs):
        c.tile(f"srcs[{i}]", s, (sbuf, private_hbm, shared_hbm))
        if s.size != dst.size:
            c.fail(f"srcs[{i}] has {s.size} elements; dst has {dst.size}")
        v = _dtypes.to_f32(np.asarray(s.read(c.name)).reshape(-1))
        total = v if total is None else total + v
    dst.write(total.reshape(dst.shape), c.name)
    return c.record("DMA", nbytes=dst.size * dst.itemsize * (len(srcs) + 1), rows=min(dst.shape[0], 128),
                    elements=dst.size)
