"""The Tensor Engine: nc_matmul (PSUM accumulation) and nc_transpose."""
from __future__ import annotations

import math

import numpy as np

from .. import _dtypes
from .._state import fail
from ..tensor import NkiTensor, psum, sbuf
from . import constants
from .constants import engine, matmul_perf_mode
from ._call import _Call, _psum_state


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """``dst = stationary.T @ moving`` on the Tensor Engine, accumulating in PSUM (float32)."""
    c = _Call("nc_matmul")
    c.tile("dst", dst, (psum,), write=True, why="the Tensor Engine writes its results to PSUM")
    c.tile("stationary", stationary, (sbuf,), why="the Tensor Engine reads its operands from SBUF")
    c.tile("moving", moving, (sbuf,), why="the Tensor Engine reads its operands from SBUF")
    double = perf_mode is matmul_perf_mode.double_row
    rows, cols = 128, 128
    if tile_position or tile_size:
        if not (tile_position and tile_size):
            c.fail("tile_position and tile_size must both be set to enable tiling mode")
        rows, cols = int(tile_size[0]), int(tile_size[1])
        r0, c0 = int(tile_position[0]), int(tile_position[1])
        if rows not in (32, 64, 128) or cols not in (32, 64, 128):
            c.fail(f"tile_size {tuple(tile_size)}: row and column tile sizes must be 32, 64 or 128")
        if r0 % rows or c0 % cols or r0 + rows > 128 or c0 + cols > 128:
            c.fail(f"tile_position {tuple(tile_position)} must be a multiple of tile_size {tuple(tile_size)} inside the "
                   "128x128 array")
        if double and cols < 128:
            c.fail("double_row performance mode cannot be combined with column tiling")
    k, k2 = stationary.shape[0], moving.shape[0]
    if k != k2:
        c.fail(f"stationary has {k} partitions (contraction) but moving has {k2} (shapes {stationary.shape}, "
               f"{moving.shape})")
    if k > rows:
        c.fail(f"contraction (partition) dimension {k} exceeds {rows}")
    if double:
        if not (_dtypes.is_fp8(stationary.dtype) and _dtypes.is_fp8(moving.dtype)):
            c.fail("double_row performance mode needs float8 stationary and moving")
        if stationary.ndim < 3 or moving.ndim < 3 or stationary.shape[1] != 2 or moving.shape[1] != 2:
            c.fail(f"double_row needs shapes [K, 2, M] and [K, 2, N], got {stationary.shape}, {moving.shape}")
        m, n = math.prod(stationary.shape[2:]), math.prod(moving.shape[2:])
    else:
        m, n = c.pf(stationary)[1], c.pf(moving)[1]
    if m > cols:
        c.fail(f"stationary free size {m} exceeds {cols} (nl.tile_size.gemm_stationary_fmax)")
    if n > 512:
        c.fail(f"moving free size {n} exceeds 512 (nl.tile_size.gemm_moving_fmax: one PSUM bank of float32)")
    if dst.shape[0] != m or c.pf(dst)[1] != n:
        c.fail(f"dst {dst.shape} must have {m} partitions (stationary's free size) and {n} elements per partition "
               f"(moving's free size)")
    f32_in = [d in (_dtypes.float32, _dtypes.tfloat32) for d in (stationary.dtype, moving.dtype)]
    if any(f32_in) and not all(f32_in):
        c.fail(f"if one operand is float32/tfloat32 the other must be too ({_dtypes.name(stationary.dtype)}, "
               f"{_dtypes.name(moving.dtype)})")
    for role, t in (("stationary", stationary), ("moving", moving)):
        if _dtypes.is_int(t.dtype) or t.dtype == _dtypes.float8_e8m0fnu:
            c.fail(f"{role} dtype {_dtypes.name(t.dtype)} is not a Tensor Engine input type "
                   "(float8_e4m3/float8_e5m2/bfloat16/float16/tfloat32/float32)")
        if t.dtype == _dtypes.float8_e4m3fn:
            c.fail(f"{role}: float8_e4m3fn (OCP FP8) matmul needs NeuronCore-v4; use float8_e4m3 on NeuronCore-v3")
    if is_transpose:
        if dst.dtype != stationary.dtype and dst.dtype != _dtypes.float32:
            c.fail("transpose mode writes float32 or the input's own dtype")
    elif dst.dtype != _dtypes.float32:
        c.fail(f"dst must be float32 on NeuronCore-v3 (got {_dtypes.name(dst.dtype)})")
    s = c.read(stationary, f32=False)
    mv = c.read(moving, f32=False)
    if double:
        s = np.asarray(stationary.read("nc_matmul")).reshape(k * 2, m)
        mv = np.asarray(moving.read("nc_matmul")).reshape(k * 2, n)
    if is_transpose:
        eye = np.asarray(mv, dtype=np.float32)
        if eye.shape[0] == eye.shape[1] and np.array_equal(eye, np.eye(eye.shape[0], dtype=np.float32)):
            result = np.asarray(s).T  # bit-accurate transpose (NeuronCore-v3 transpose mode)
        else:
            result = _dtypes.to_f32(s).T @ _dtypes.to_f32(mv)
    else:
        result = np.matmul(_dtypes.to_f32(s).T, _dtypes.to_f32(mv), dtype=np.float32)
    state = _psum_state(dst).reshape(m, n) if not dst.is_indirect() else np.zeros((m, n), np.uint8)
    if accumulate is True:
        if (state == 0).any():
            c.fail("accumulate=True onto PSUM locations no matmul has written (undefined behaviour on hardware; "
                   "the first matmul of an accumulation group must overwrite)")
        acc = np.ones((m, n), dtype=bool)
    elif accumulate is False or is_transpose:
        acc = np.zeros((m, n), dtype=bool)
    else:
        acc = state == 1  # auto: accumulate where a matmul group is open
    if acc.any():
        old = _dtypes.to_f32(np.asarray(dst.read("nc_matmul")).reshape(m, n))
        result = np.where(acc, old + _dtypes.to_f32(result), result)
    dst.write(result.reshape(dst.shape), "nc_matmul")
    st = _psum_state(dst)
    st[...] = 0 if is_transpose else 1
    return c.record("TensorE", N_stationary=m, N_moving=n, K=k, fp32=all(f32_in), double_row=double,
                    accumulated=bool(acc.any()), elements=n)


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    fail("nc_matmul_mx", "MXFP8/MXFP4 matmul is available on NeuronCore-v4 (Trn3) only; the simulator models "
         "NeuronCore-v3 (Trn2)")


def quantize_mx(dst, src, dst_scale, name=None):
    fail("quantize_mx", "MX quantization is available on NeuronCore-v4 (Trn3) only; the simulator models NeuronCore-v3")


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """2-D transpose of ``data`` (free axes flattened) on the Tensor Engine (SBUF -> PSUM, up to
    128x128) or the Vector Engine (up to 32x32)."""
    c = _Call("nc_transpose")
    p, f = (data.shape[0], math.prod(data.shape[1:])) if isinstance(data, NkiTensor) else (0, 0)
    if isinstance(engine, constants.engine) and engine is not constants.engine.unknown:
        eng = c.engine(engine, "TensorE", ("TensorE", "VectorE"))
    else:
        eng = "TensorE" if (isinstance(dst, NkiTensor) and dst.buffer is psum and data.buffer is sbuf) or p > 32 or f > 32 \
            else "VectorE"
    if eng == "TensorE":
        c.tile("dst", dst, (psum,), write=True, why="the Tensor Engine writes its results to PSUM")
        c.tile("data", data, (sbuf,), why="the Tensor Engine reads SBUF")
        if p > 128 or f > 128:
            c.fail(f"data {data.shape} is {p}x{f}; the Tensor Engine transposes at most 128x128")
    else:
        c.tile("dst", dst, write=True)
        c.tile("data", data)
        if p > 32 or f > 32:
            c.fail(f"data {data.shape} is {p}x{f}; the Vector Engine transposes at most 32x32")
    if dst.dtype != data.dtype:
        c.fail(f"dst dtype {_dtypes.name(dst.dtype)} must equal data dtype {_dtypes.name(data.dtype)}")
    if dst.shape[0] != f or c.pf(dst)[1] != p:
        c.fail(f"dst {dst.shape} must be ({f}, {p}) for data {data.shape}")
    values = c.read(data, f32=False)
    c.write(dst, values.T)
    return c.record(eng, P=p, F=f, elements=f)
