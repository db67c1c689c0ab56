"""Vector Engine instructions: element-wise, reductions, scans, statistics, top-8, shuffles."""
from __future__ import annotations

import math

import numpy as np

from .. import _dtypes
from .._ops import as_op
from ..tensor import psum, sbuf
from . import constants
from .constants import engine, reduce_cmd
from ._call import _apply_scalar, _binary, _Call, _is_int_tile, _reduce_rows


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = data1 <op> data2`` element-wise (Vector or GpSimd engine)."""
    c = _Call("tensor_tensor")
    c.tile("dst", dst, write=True)
    c.tile("data1", data1, why="compute engines read SBUF/PSUM only; use nisa.dma_copy for HBM")
    c.tile("data2", data2, why="compute engines read SBUF/PSUM only; use nisa.dma_copy for HBM")
    op = as_op(op, "tensor_tensor")
    if op.arity != 2:
        c.fail(f"op={op!r} is not a binary operator")
    c.same_pf("data1", data1, "data2", data2)
    c.same_pf("dst", dst, "data1", data1)
    if data1.buffer is psum and data2.buffer is psum:
        c.fail("data1 and data2 cannot both be in PSUM")
    ints = all(_is_int_tile(t) for t in (dst, data1, data2))
    any_psum = any(t.buffer is psum for t in (dst, data1, data2))
    default = "GpSimd" if (op.name == "power" or (ints and all(t.dtype.itemsize == 4 for t in (dst, data1, data2)))) \
        and not any_psum else "VectorE"
    eng = c.engine(engine, default, ("VectorE", "GpSimd"))
    if op.name == "power":
        eng = "GpSimd"
    c.check_gpsimd_psum(eng)
    if op.bitvec:
        if not ints:
            c.fail(f"bitvec operator {op!r} needs integer dtypes")
        a, b = c.read(data1, f32=False), c.read(data2, f32=False)
        result = op.fn(a.astype(np.int64), b.astype(np.int64))
    elif ints and eng == "GpSimd":
        a, b = c.read(data1, f32=False).astype(np.int64), c.read(data2, f32=False).astype(np.int64)
        with np.errstate(all="ignore"):
            result = op.apply(a, b)
    else:
        result = _binary(op, c.read(data1), c.read(data2), False)
    c.write(dst, result)
    return c.record(eng, op=op.name)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """``dst = (data <op0> operand0) <op1> operand1``, operands broadcast along the free dimension."""
    c = _Call("tensor_scalar")
    c.tile("dst", dst, write=True)
    c.tile("data", data, why="compute engines read SBUF/PSUM only; use nisa.dma_copy for HBM")
    c.same_pf("dst", dst, "data", data)
    op0 = as_op(op0, "tensor_scalar", "op0")
    op1 = as_op(op1, "tensor_scalar", "op1") if op1 is not None else None
    p = data.shape[0]
    a0 = c.scalar_or_vector("operand0", operand0, p, allow_none=op0.arity == 1)
    a1 = c.scalar_or_vector("operand1", operand1, p, allow_none=op1 is None or op1.arity == 1)
    bitvec = op0.bitvec or (op1 is not None and op1.bitvec)
    if op1 is not None and op0.bitvec != op1.bitvec and op1.name != "bypass" and op0.name != "bypass":
        c.fail(f"op0={op0!r} and op1={op1!r} must both be bitvec or both arithmetic")
    eng = c.engine(engine, "VectorE", ("VectorE", "ScalarE", "GpSimd"))
    if eng == "ScalarE":
        combo = (op0.name, op1.name if op1 is not None else None)
        if combo not in (("multiply", "add"), ("multiply", None), ("add", None)):
            c.fail(f"the Scalar Engine runs only (multiply, add), (multiply, None) and (add, None); got {combo}")
    if eng == "GpSimd" and op0.name != "rsqrt":
        c.fail("the GpSimd engine runs tensor_scalar for nl.rsqrt only")
    c.check_gpsimd_psum(eng)
    if bitvec:
        if not (_is_int_tile(data) and _is_int_tile(dst)):
            c.fail("bitvec operators need integer dtypes")
        values = c.read(data, f32=False).astype(np.int64)
        conv = lambda x: None if x is None else np.asarray(x).astype(np.int64)  # noqa: E731
        result = _apply_scalar(op0, values, conv(a0), reverse0)
        result = _apply_scalar(op1, result, conv(a1), reverse1)
    else:
        result = _apply_scalar(op0, c.read(data), a0, reverse0)
        result = _apply_scalar(op1, np.asarray(result, dtype=np.float32), a1, reverse1)
    c.write(dst, result)
    return c.record(eng, op=op0.name)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """``dst = (data <op0> operand0) <op1> operand1`` with ``operand1`` a full tile (Vector Engine)."""
    c = _Call("scalar_tensor_tensor")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    c.tile("operand1", operand1)
    c.same_pf("dst", dst, "data", data)
    c.same_pf("data", data, "operand1", operand1)
    if data.buffer is psum and operand1.buffer is psum:
        c.fail("data and operand1 cannot both be in PSUM")
    op0, op1 = as_op(op0, c.name, "op0"), as_op(op1, c.name, "op1")
    if op0.bitvec or op1.bitvec:
        c.fail("scalar_tensor_tensor takes arithmetic operators only")
    a0 = c.scalar_or_vector("operand0", operand0, data.shape[0])
    tmp = _apply_scalar(op0, c.read(data), a0, reverse0)
    result = _apply_scalar(op1, np.asarray(tmp, np.float32), c.read(operand1), reverse1)
    c.write(dst, result)
    return c.record("VectorE", ops=(op0.name, op1.name))


def _reduce_axes(c, data, axis):
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    axes = sorted(a + data.ndim if a < 0 else a for a in axes)
    if not axes or 0 in axes:
        c.fail(f"axis={axis}: the partition axis (0) cannot be reduced; reduce free axes")
    if axes != list(range(axes[0], data.ndim)):
        c.fail(f"axis={axis}: the reduction axes must be the last contiguous free axes of {data.shape}")
    return axes


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the last free axes of ``data`` with ``op`` (Vector Engine)."""
    c = _Call("tensor_reduce")
    c.tile("dst", dst, write=True)
    c.tile("data", data, why="compute engines read SBUF/PSUM only")
    op = as_op(op, "tensor_reduce")
    if op.reduce_identity is None and op.name not in ("average",):
        c.fail(f"{op!r} is not a reduction operator")
    axes = _reduce_axes(c, data, axis)
    p = data.shape[0]
    keep = math.prod(data.shape[1:axes[0]])
    red = math.prod(data.shape[axes[0]:])
    if dst.shape[0] != p or c.pf(dst)[1] != keep:
        c.fail(f"dst {dst.shape} must have {p} partitions and {keep} elements per partition (data {data.shape} "
               f"reduced over axes {axes})")
    if op.bitvec:
        values = c.read(data, f32=False).reshape(p * keep, red)
    else:
        values = c.read(data).reshape(p * keep, red)
    result = op.reduce(values)
    if negate:
        if op.bitvec:
            c.fail("negate applies to arithmetic operators only")
        result = -result
    c.write(dst, result.reshape(p, keep))
    return c.record("VectorE", op=op.name, elements=keep * red)


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce across the partitions of ``data`` (GpSimd engine)."""
    c = _Call("tensor_partition_reduce")
    c.tile("dst", dst, (sbuf,), write=True, why="the GpSimd engine cannot access PSUM")
    c.tile("data", data, (sbuf,), why="the GpSimd engine cannot access PSUM")
    op = as_op(op, c.name)
    values = c.read(data, f32=not op.bitvec)
    if op.name == "average":
        result = values.mean(axis=0, dtype=np.float32)
    else:
        result = op.reduce(values.T)
    if dst.shape[0] != 1 or c.pf(dst)[1] != values.shape[1]:
        c.fail(f"dst {dst.shape} must be one partition of {values.shape[1]} elements")
    c.write(dst, result.reshape(1, -1))
    return c.record("GpSimd", op=op.name)


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` on the Vector Engine."""
    c = _Call("reciprocal")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    c.same_pf("dst", dst, "data", data)
    with np.errstate(divide="ignore"):
        c.write(dst, np.float32(1) / c.read(data))
    return c.record("VectorE")


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` with ``r[-1] = initial``."""
    c = _Call("tensor_tensor_scan")
    c.tile("dst", dst, write=True)
    c.tile("data0", data0)
    c.tile("data1", data1)
    c.same_pf("data0", data0, "data1", data1)
    c.same_pf("dst", dst, "data0", data0)
    if data0.buffer is psum and data1.buffer is psum:
        c.fail("data0 and data1 cannot both be in PSUM")
    op0, op1 = as_op(op0, c.name, "op0"), as_op(op1, c.name, "op1")
    p, n = c.pf(data0)
    init = c.scalar_or_vector("initial", initial, p)
    a, b = c.read(data0), c.read(data1)
    out = np.empty((p, n), dtype=np.float32)
    prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (p,)).astype(np.float32)
    with np.errstate(all="ignore"):
        if op0.name == "multiply" and op1.name == "add" and not reverse0 and not reverse1 and np.all(a == 1):
            out = (np.cumsum(np.concatenate([prev[:, None], b], axis=1), axis=1, dtype=np.float32)[:, 1:])
            # cumsum in float32 accumulates left to right, as the scan does
        else:
            for i in range(n):
                x = op0.apply(prev, a[:, i]) if reverse0 else op0.apply(a[:, i], prev)
                prev = (op1.apply(b[:, i], x) if reverse1 else op1.apply(x, b[:, i])).astype(np.float32)
                out[:, i] = prev
    c.write(dst, out)
    return c.record("VectorE", op=op1.name)


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=reduce_cmd.reset_reduce, name=None):
    """Per partition: ``reg = op1(op0(src[i], imm0), reg); dst[i] = reg`` (Vector Engine accumulator)."""
    c = _Call("tensor_scalar_cumulative")
    c.tile("dst", dst, write=True)
    c.tile("src", src)
    c.same_pf("dst", dst, "src", src)
    op0, op1 = as_op(op0, c.name, "op0"), as_op(op1, c.name, "op1")
    p, n = c.pf(src)
    a0 = c.scalar_or_vector("imm0", imm0, p)
    acc = c.program.vector_acc
    if reduce_cmd is constants.reduce_cmd.reset_reduce:
        acc[:p] = np.float32(op1.reduce_identity if op1.reduce_identity is not None else 0)
    elif reduce_cmd is constants.reduce_cmd.load_reduce:
        acc[:p] = np.broadcast_to(np.asarray(c.scalar_or_vector("imm1", imm1, p), np.float32).reshape(-1), (p,))
    x = c.read(src)
    out = np.empty((p, n), dtype=np.float32)
    reg = acc[:p].copy()
    with np.errstate(all="ignore"):
        t = _apply_scalar(op0, x, a0, False)
        for i in range(n):
            reg = op1.apply(t[:, i], reg).astype(np.float32)
            out[:, i] = reg
    acc[:p] = reg
    c.write(dst, out)
    return c.record("VectorE", op=op1.name)


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """``dst = data <op0> operand0`` plus a free-axis reduction into ``reduce_res`` (Vector Engine)."""
    c = _Call("tensor_scalar_reduce")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    c.same_pf("dst", dst, "data", data)
    op0 = as_op(op0, c.name, "op0")
    rop = as_op(reduce_op, c.name, "reduce_op")
    if op0.bitvec:
        c.fail("op0 must be an arithmetic operator")
    p = data.shape[0]
    a0 = c.scalar_or_vector("operand0", operand0, p, allow_none=op0.arity == 1)
    out = np.asarray(_apply_scalar(op0, c.read(data), a0, reverse0), np.float32)
    acc = c.program.vector_acc
    if reduce_cmd is constants.reduce_cmd.reset_reduce:
        acc[:p] = np.float32(rop.reduce_identity)
    elif reduce_cmd is constants.reduce_cmd.load_reduce:
        acc[:p] = np.broadcast_to(np.asarray(c.scalar_or_vector("reduce_init", reduce_init, p), np.float32).reshape(-1), (p,))
    acc[:p] = rop.apply(acc[:p], _reduce_rows(rop, _dtypes.to_f32(_dtypes.cast(out, dst.dtype))))
    c.write(dst, out)
    if reduce_res is not None:
        c.tile("reduce_res", reduce_res, write=True)
        c.write(reduce_res, (-acc[:p] if reduce_res_negate else acc[:p]).reshape(p, 1))
    return c.record("VectorE", op=op0.name)


def bn_stats(dst, data, name=None):
    """Per partition: count, mean, variance*count of the even elements, then of the odd ones."""
    c = _Call("bn_stats")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    p, n = c.pf(data)
    if n > 512:
        c.fail(f"data has {n} elements per partition; bn_stats takes at most 512 (nl.tile_size.bn_stats_fmax)")
    if dst.shape[0] != p or c.pf(dst)[1] != 6:
        c.fail(f"dst must be ({p}, 6), got {dst.shape}")
    x = c.read(data).astype(np.float64)
    out = np.zeros((p, 6), dtype=np.float64)
    for j, part in enumerate((x[:, 0::2], x[:, 1::2])):
        cnt = part.shape[1]
        mean = part.mean(axis=1) if cnt else np.zeros(p)
        out[:, 3 * j] = cnt
        out[:, 3 * j + 1] = mean
        out[:, 3 * j + 2] = ((part - mean[:, None]) ** 2).sum(axis=1) if cnt else 0
    c.write(dst, out.astype(np.float32))
    return c.record("VectorE")


def bn_aggr(dst, data, name=None):
    """Aggregate ``bn_stats`` triples (count, mean, variance*count) into (mean, variance)."""
    c = _Call("bn_aggr")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    p, n = c.pf(data)
    if n % 3:
        c.fail(f"data has {n} elements per partition, not a multiple of 3")
    if dst.shape[0] != p or c.pf(dst)[1] != 2:
        c.fail(f"dst must be ({p}, 2), got {dst.shape}")
    t = c.read(data).astype(np.float64).reshape(p, n // 3, 3)
    cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    total = cnt.sum(axis=1)
    safe = np.where(total > 0, total, 1)
    mu = (cnt * mean).sum(axis=1) / safe
    var = (m2 + cnt * (mean - mu[:, None]) ** 2).sum(axis=1) / safe
    c.write(dst, np.stack([mu, var], axis=1).astype(np.float32))
    return c.record("VectorE")


def max8(dst, src, name=None):
    """The 8 largest values of each partition, descending (Vector Engine)."""
    c = _Call("max8")
    c.tile("dst", dst, write=True)
    c.tile("src", src)
    p, n = c.pf(src)
    if not 8 <= n <= 16384:
        c.fail(f"src has {n} elements per partition; max8 reads between 8 and 16384")
    if dst.shape[0] != p or c.pf(dst)[1] != 8:
        c.fail(f"dst must be ({p}, 8), got {dst.shape}")
    x = c.read(src)
    top = -np.sort(-x, axis=1, kind="stable")[:, :8]
    c.write(dst, top)
    return c.record("VectorE", elements=n)


def nc_find_index8(dst, data, vals, name=None):
    """Index of the first occurrence of each of 8 values per partition (duplicates take successive
    matches); not found: all ones."""
    c = _Call("nc_find_index8")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    c.tile("vals", vals)
    p, n = c.pf(data)
    if not 8 <= n <= 16384:
        c.fail(f"data has {n} elements per partition; between 8 and 16384 are allowed")
    if c.pf(vals) != (p, 8) or c.pf(dst) != (p, 8):
        c.fail(f"vals and dst must have {p} partitions x 8 elements (got {vals.shape}, {dst.shape})")
    if dst.dtype not in (_dtypes.uint32, _dtypes.uint16, _dtypes.int32):
        c.fail(f"dst must be uint32 or uint16, got {_dtypes.name(dst.dtype)}")
    x, v = c.read(data), c.read(vals)
    sentinel = np.iinfo(dst.dtype).max if dst.dtype != _dtypes.int32 else -1
    out = np.full((p, 8), sentinel, dtype=np.int64)
    for row in range(p):
        used = set()
        for j in range(8):
            hits = np.flatnonzero(x[row] == v[row, j])
            for h in hits:
                if h not in used:
                    used.add(int(h))
                    out[row, j] = h
                    break
    c.write(dst, out)
    return c.record("VectorE", elements=n)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Replace the first occurrence of each of 8 values per partition by ``imm`` (vals taken in
    reverse order, so duplicates pair with matches in descending slots); indices to ``dst_idx``."""
    c = _Call("nc_match_replace8")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    c.tile("vals", vals)
    c.same_pf("dst", dst, "data", data)
    p, n = c.pf(data)
    if c.pf(vals) != (p, 8):
        c.fail(f"vals must have {p} partitions x 8 elements, got {vals.shape}")
    x, v = c.read(data).copy(), c.read(vals)
    idx = np.full((p, 8), -1, dtype=np.int64)
    for row in range(p):
        used = set()
        for j in range(7, -1, -1):
            for h in np.flatnonzero(x[row] == v[row, j]):
                if int(h) not in used:
                    used.add(int(h))
                    idx[row, j] = h
                    break
        for h in used:
            x[row, h] = np.float32(imm)
    c.write(dst, x)
    if dst_idx is not None:
        c.tile("dst_idx", dst_idx, write=True)
        if _dtypes.is_int(dst_idx.dtype) and dst_idx.dtype.kind == "u":
            idx = np.where(idx < 0, np.iinfo(dst_idx.dtype).max, idx)
        c.write(dst_idx, idx)
    return c.record("VectorE", elements=n)


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each quadrant of 32 partitions, output partition i copies input partition
    ``shuffle_mask[i]`` (255: unchanged) (Vector Engine)."""
    c = _Call("nc_stream_shuffle")
    c.tile("dst", dst, write=True)
    c.tile("src", src)
    if dst.dtype != src.dtype:
        c.fail("dst must have src's dtype")
    if c.pf(dst)[1] != c.pf(src)[1]:
        c.fail(f"dst and src must have the same elements per partition ({dst.shape}, {src.shape})")
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32:
        c.fail(f"shuffle_mask must have 32 entries, got {len(mask)}")
    ps, pd = src.shape[0], dst.shape[0]
    x = c.read(src, f32=False).copy()
    out = c.read(dst, f32=False).copy()
    for q in range(math.ceil(max(ps, pd) / 32)):
        for i, m in enumerate(mask):
            if m == 255:
                continue
            d, s = q * 32 + i, q * 32 + m
            if d < pd and s < ps:
                out[d] = x[s]
    c.write(dst, out)
    return c.record("VectorE")
