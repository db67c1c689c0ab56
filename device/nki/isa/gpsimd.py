"""GpSimd patterns and selections (iota, affine_select, range_select ...), PRNG, gathers."""
from __future__ import annotations

import math

import numpy as np

from .. import _dtypes
from .._ops import as_op, OPS
from .._state import fail
from ..tensor import psum, sbuf
from . import constants
from .constants import engine, reduce_cmd
from ._call import _Call, FP32_MIN


def _pattern_values(c, dst, pattern, offset, channel_multiplier):
    pattern = [(int(s), int(n)) for s, n in pattern]
    if len(pattern) > 4:
        c.fail(f"pattern has {len(pattern)} dimensions; at most 4")
    n = math.prod(cnt for _, cnt in pattern)
    p, free = c.pf(dst)
    if n != free:
        c.fail(f"pattern {pattern} generates {n} elements per partition but dst {dst.shape} has {free}")
    values = np.zeros([p] + [cnt for _, cnt in pattern], dtype=np.int64) + int(offset)
    values += (np.arange(p, dtype=np.int64) * int(channel_multiplier)).reshape([p] + [1] * len(pattern))
    for d, (step, cnt) in enumerate(pattern):
        shape = [1] * (len(pattern) + 1)
        shape[d + 1] = cnt
        values += (np.arange(cnt, dtype=np.int64) * step).reshape(shape)
    return values.reshape(p, free)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """``dst[p, ...] = offset + p * channel_multiplier + sum(step * index)`` (GpSimd engine, int32)."""
    c = _Call("iota")
    c.tile("dst", dst, (sbuf,), write=True, why="iota writes SBUF")
    values = _pattern_values(c, dst, pattern, offset, channel_multiplier).astype(np.int32).astype(np.int64)
    c.write(dst, values if _dtypes.is_int(dst.dtype) else values.astype(np.float32))
    return c.record("GpSimd")


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=OPS["equal"], offset=0,
                  name=None):
    """``dst = on_true_tile where cmp_op(affine(p, i), 0) else on_false_value`` (GpSimd engine)."""
    c = _Call("affine_select")
    c.tile("dst", dst, (sbuf,), write=True, why="affine_select writes SBUF (GpSimd)")
    c.tile("on_true_tile", on_true_tile, (sbuf,), why="the GpSimd engine cannot access PSUM")
    c.same_pf("dst", dst, "on_true_tile", on_true_tile)
    cmp = as_op(cmp_op, c.name, "cmp_op")
    affine = _pattern_values(c, dst, pattern, offset, channel_multiplier).astype(np.float64)
    pred = cmp.apply(affine, np.zeros_like(affine)) != 0
    true_vals = c.read(on_true_tile, f32=on_true_tile.dtype != dst.dtype)
    out = np.where(pred, _dtypes.to_f32(true_vals) if on_true_tile.dtype != dst.dtype else true_vals,
                   np.float32(on_false_value))
    if on_true_tile.dtype == dst.dtype and not _dtypes.is_float(dst.dtype):
        out = np.where(pred, true_vals, on_false_value)
    c.write(dst, out)
    return c.record("GpSimd")


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=OPS["maximum"], range_start=0, on_false_value=FP32_MIN, name=None):
    """Keep ``on_true_tile`` where ``comp_op0(i + range_start, bound0) and comp_op1(i + range_start,
    bound1)`` (i = free index), else ``on_false_value``; max-reduce into ``reduce_res`` (Vector Engine)."""
    c = _Call("range_select")
    c.tile("dst", dst, write=True)
    c.tile("on_true_tile", on_true_tile)
    c.same_pf("dst", dst, "on_true_tile", on_true_tile)
    p, n = c.pf(on_true_tile)
    b0 = c.scalar_or_vector("bound0", bound0, p)
    b1 = c.scalar_or_vector("bound1", bound1, p)
    op0, op1 = as_op(comp_op0, c.name, "comp_op0"), as_op(comp_op1, c.name, "comp_op1")
    for op in (op0, op1):
        if op.name not in ("equal", "less", "less_equal", "greater", "greater_equal"):
            c.fail(f"comparison operators must be nl.equal/less/less_equal/greater/greater_equal, got {op!r}")
    rop = as_op(reduce_op, c.name, "reduce_op")
    if rop.name != "maximum":
        c.fail("reduce_op must be nl.maximum")
    idx = np.float32(range_start) + np.arange(n, dtype=np.float32)[None, :]
    mask = (op0.apply(idx, b0) != 0) & (op1.apply(idx, b1) != 0)
    out = np.where(mask, c.read(on_true_tile), np.float32(on_false_value))
    acc = c.program.vector_acc
    if reduce_cmd in (constants.reduce_cmd.reset_reduce, constants.reduce_cmd.reset):
        acc[:p] = -np.inf
    if reduce_cmd in (constants.reduce_cmd.reset_reduce, constants.reduce_cmd.reduce):
        acc[:p] = np.maximum(acc[:p], _dtypes.to_f32(_dtypes.cast(out, dst.dtype)).max(axis=1))
    c.write(dst, out)
    if reduce_res is not None:
        c.tile("reduce_res", reduce_res, write=True)
        c.write(reduce_res, acc[:p].reshape(p, 1))
    return c.record("VectorE")


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=OPS["maximum"], reverse_pred=False, name=None):
    """``dst = where(predicate, on_true, on_false)`` with an optional max-reduce (Vector Engine)."""
    c = _Call("select_reduce")
    c.tile("dst", dst, write=True)
    c.tile("predicate", predicate)
    c.tile("on_true", on_true)
    c.same_pf("dst", dst, "on_true", on_true)
    c.same_pf("dst", dst, "predicate", predicate)
    if on_true.buffer is psum and predicate.buffer is psum:
        c.fail("on_true and predicate cannot both be in PSUM")
    if not _dtypes.is_int(predicate.dtype):
        c.fail(f"predicate must be an integer type, got {_dtypes.name(predicate.dtype)}")
    p = dst.shape[0]
    fv = c.scalar_or_vector("on_false", on_false, p)
    pred = c.read(predicate, f32=False) != 0
    if reverse_pred:
        pred = ~pred
    out = np.where(pred, c.read(on_true), fv)
    acc = c.program.vector_acc
    if reduce_cmd is constants.reduce_cmd.reset_reduce:
        acc[:p] = -np.inf
    if reduce_cmd in (constants.reduce_cmd.reset_reduce, constants.reduce_cmd.reduce):
        acc[:p] = np.maximum(acc[:p], out.max(axis=1))
    c.write(dst, out)
    if reduce_res is not None:
        c.tile("reduce_res", reduce_res, write=True)
        c.write(reduce_res, acc[:p].reshape(p, 1))
    return c.record("VectorE")


def dropout(dst, data, prob, name=None):
    """Zero each element with probability ``prob`` (per partition or scalar) (Vector Engine)."""
    c = _Call("dropout")
    c.tile("dst", dst, write=True)
    c.tile("data", data)
    c.same_pf("dst", dst, "data", data)
    if dst.dtype != data.dtype:
        c.fail("dst.dtype must match data.dtype")
    p, n = c.pf(data)
    pr = c.scalar_or_vector("prob", prob, p)
    keep = c.program.rng.random((p, n), dtype=np.float32) >= pr
    values = c.read(data, f32=False)
    c.write(dst, np.where(keep, values, np.zeros((), dtype=values.dtype)))
    return c.record("VectorE")


def rng(dst, engine=engine.vector, name=None):
    """32 random bits per element, truncated to ``dst.dtype`` (an integer type)."""
    c = _Call("rng")
    c.tile("dst", dst, write=True)
    eng = c.engine(engine, "VectorE", ("VectorE", "GpSimd"))
    c.check_gpsimd_psum(eng)
    if not _dtypes.is_int(dst.dtype):
        c.fail(f"dst must be an integer type, got {_dtypes.name(dst.dtype)}")
    bits = c.program.rng.integers(0, 2 ** 32, size=dst.shape, dtype=np.uint64)
    dst.write(bits.astype(np.uint32).view(np.uint32).astype(dst.dtype) if dst.itemsize == 4
              else (bits & ((1 << (8 * dst.itemsize)) - 1)).astype(dst.dtype), c.name)
    return c.record(eng)


def set_rng_seed(src_seeds, name=None):
    """Seed the Vector Engine PRNG from a [1, 1] 32-bit tensor."""
    c = _Call("set_rng_seed")
    c.tile("src_seeds", src_seeds)
    seed = int(np.asarray(src_seeds.read(c.name)).reshape(-1)[0])
    c.program.rng = np.random.default_rng(seed & 0xFFFFFFFF)
    return c.record("VectorE")


def rand_set_state(src_seeds, engine=engine.gpsimd, name=None):
    c = _Call("rand_set_state")
    c.tile("src_seeds", src_seeds, (sbuf,))
    seed = np.asarray(src_seeds.read(c.name)).astype(np.uint64).reshape(-1)
    c.program.rng = np.random.default_rng([int(x) for x in seed])
    return c.record(c.engine(engine, "GpSimd", ("GpSimd", "VectorE")))


def rand_get_state(dst, engine=engine.gpsimd, name=None):
    c = _Call("rand_get_state")
    c.tile("dst", dst, write=True)
    state = c.program.rng.bit_generator.state
    seed = int(str(state["state"]["state"])[-9:])
    c.write(dst, np.full(dst.shape, seed % (2 ** 32), dtype=np.int64))
    return c.record(c.engine(engine, "GpSimd", ("GpSimd", "VectorE")))


def nc_n_gather(dst, data, indices, name=None):
    """Per partition: ``dst[p, j] = data[p].flat[indices[p, j]]`` (GpSimd engine)."""
    c = _Call("nc_n_gather")
    c.tile("dst", dst, (sbuf,), write=True, why="the GpSimd engine cannot access PSUM")
    c.tile("data", data, (sbuf,), why="the GpSimd engine cannot access PSUM")
    c.tile("indices", indices, (sbuf,), why="the GpSimd engine cannot access PSUM")
    p, n = c.pf(data)
    if dst.dtype != data.dtype:
        c.fail("dst must have data's dtype")
    if c.pf(indices)[0] != p or c.pf(dst) != c.pf(indices):
        c.fail(f"indices {indices.shape} and dst {dst.shape} must match, with data's {p} partitions")
    ix = c.read(indices, f32=False).astype(np.int64)
    if ix.size and (ix.min() < 0 or ix.max() >= n):
        c.fail(f"indices must lie in [0, {n})")
    x = c.read(data, f32=False)
    c.write(dst, np.take_along_axis(x, ix, axis=1))
    return c.record("GpSimd", elements=ix.shape[1])


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Gather within groups of 16 partitions: each GpSimd core uses its 16 partitions' indices
    (flattened partition-first) as partition offsets into its 16 partitions of ``src_buffer``."""
    c = _Call("local_gather")
    c.tile("dst", dst, (sbuf,), write=True)
    c.tile("src_buffer", src_buffer, (sbuf,))
    c.tile("index", index, (sbuf,))
    p = src_buffer.shape[0]
    if index.shape[0] != p or p % 16:
        c.fail(f"src_buffer and index must have the same partition count, a multiple of 16 (got {p}, {index.shape[0]})")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        c.fail("num_elem_per_idx must be one of 1, 2, 4, 8, 16, 32")
    if dst.dtype != src_buffer.dtype:
        c.fail("no dtype conversion: dst must have src_buffer's dtype")
    src = c.read(src_buffer, f32=False)
    ix = c.read(index, f32=False).astype(np.int64)
    groups = p // 16
    per_core = ix.size // groups
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if valid > per_core:
        c.fail(f"num_valid_indices {valid} exceeds the {per_core} indices of each 16-partition slice")
    out = np.empty((p, valid * num_elem_per_idx), dtype=src.dtype)
    for g in range(groups):
        flat = ix[g * 16:(g + 1) * 16].flatten(order="F")[:valid]  # partition dimension first
        cols = (flat[:, None] + np.arange(num_elem_per_idx)[None, :]).reshape(-1)
        if cols.size and (cols.min() < 0 or cols.max() >= src.shape[1]):
            c.fail(f"gather index out of range [0, {src.shape[1]})")
        out[g * 16:(g + 1) * 16] = src[g * 16:(g + 1) * 16][:, cols]
    if out.size != dst.size:
        c.fail(f"the gather yields {out.size} elements; dst {dst.shape} holds {dst.size}")
    c.write(dst, out)
    return c.record("GpSimd", elements=valid * num_elem_per_idx)


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """Indices of the nonzero elements, padding, then the count, on partitions 0, 16, ..., 112."""
    c = _Call("nonzero_with_count")
    c.tile("dst", dst, (sbuf,), write=True)
    c.tile("src", src, (sbuf,))
    p, n = c.pf(src)
    if c.pf(dst) != (p, n + 1):
        c.fail(f"dst must be ({p}, {n + 1}), got {dst.shape}")
    x = c.read(src, f32=False)
    out = c.read(dst, f32=False).astype(np.int64).copy()
    for row in range(0, p, 16):
        nz = np.flatnonzero(x[row]) + int(index_offset)
        out[row, :] = int(padding_val)
        out[row, :nz.size] = nz
        out[row, n] = nz.size
    c.write(dst, out)
    return c.record("GpSimd", elements=n)


def sequence_bounds(dst, segment_ids, name=None):
    """For each element, the [start, end] of its segment (segment id 0 is padding: [n, -1])."""
    c = _Call("sequence_bounds")
    c.tile("dst", dst, write=True)
    c.tile("segment_ids", segment_ids)
    p, n = c.pf(segment_ids)
    if p != 1:
        c.fail("the partition dimension must be 1")
    ids = c.read(segment_ids).reshape(-1)
    out = np.zeros((2, n), dtype=np.float64)
    for i, s in enumerate(ids):
        if s == 0:
            out[:, i] = (n, -1)
        else:
            where_s = np.flatnonzero(ids == s)
            out[:, i] = (where_s.min(), where_s.max())
    c.write(dst, out.reshape(dst.shape))
    return c.record("GpSimd", elements=n)


def topk(val_dst, idx_dst, src, n, name=None):
    fail("topk", "nisa.topk (the 16-partition snake layout top-K) is not simulated yet")
