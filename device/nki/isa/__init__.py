"""``nki.isa``: the NeuronCore-v3 instructions, simulated on numpy.

Each function follows its docstring in ``nki/api/nki/isa/__init__.py`` (aws-neuron-sdk): the
output is the ``dst`` argument, operands are checked as the hardware requires (partition
dimension <= 128, the buffers each engine can reach, matching shapes, dtypes), the arithmetic is
float32 with the result cast to ``dst.dtype`` (bitvec operators work on the integer bits), and
each executed instruction is recorded in the running program's trace with its engine, operand
shapes, dtypes, bytes and the kernel's source line (``nki.cost`` turns the trace into time).
A broken constraint raises :class:`NkiValidationError` naming the instruction and the kernel line.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _dtypes
from .._ops import OPS, Op, as_op
from .._state import Instruction, NkiValidationError, current, fail, user_frame
from ..tensor import NKIObject, NkiTensor, buffer_label, psum, sbuf
from . import constants
from .constants import (dge_mode, dma_engine, engine, gpsimd_engine, matmul_perf_mode, nc_version, oob_mode,
                        reduce_cmd, scalar_engine, tensor_engine, unknown_engine, vector_engine)

_ENGINE_NAMES = {engine.tensor: "TensorE", engine.vector: "VectorE", engine.scalar: "ScalarE",
                 engine.gpsimd: "GpSimd", engine.dma: "DMA", engine.sync: "Sync"}
FP32_MIN = -3.4028235e38


class NkiInstruction(NKIObject):
    """Handle of an executed instruction; ``depends_on`` adds scheduling edges."""

    def __init__(self, handle):
        self.handle = handle

    def depends_on(self, *producers):
        for producer in producers:
            if isinstance(producer, NkiInstruction) and producer.handle is not None and self.handle is not None:
                self.handle.info.setdefault("after", []).append(producer.handle)
        return self


class VirtualRegister(NKIObject):
    """A 32-bit engine register (``nisa.register_alloc``); ``value`` is its content."""

    def __init__(self, state=None, frozen=False):
        self.value = 0 if state is None else int(state)
        self.frozen = frozen

    def __int__(self):
        return int(self.value)

    __index__ = __int__

    def __bool__(self):
        return self.value != 0

    def __repr__(self):
        return f"VirtualRegister({self.value})"


# -- the instruction call ---------------------------------------------------------------------


class _Call:
    """One instruction being executed: operand checks, then the trace record."""

    def __init__(self, name: str):
        self.name = name
        self.program = current(f"nisa.{name}")
        self.operands = []  # (role, tensor, written)

    def fail(self, message):
        location = user_frame(2)
        from .._state import where

        raise NkiValidationError(f"{self.name}: {message}\n  at {where(location)}", self.name, location)

    def tile(self, role, t, buffers=(sbuf, psum), write=False, why=None):
        if not isinstance(t, NkiTensor):
            self.fail(f"{role} must be an NkiTensor, got {type(t).__name__}")
        if t.buffer not in buffers:
            allowed = " or ".join(buffer_label(b) for b in buffers)
            self.fail(f"{role} is in {buffer_label(t.buffer)}{_named(t)}; it must be in {allowed}"
                      + (f" ({why})" if why else ""))
        if t.on_chip and t.shape[0] > 128:
            self.fail(f"{role} partition dimension {t.shape[0]} exceeds maximum 128 (nl.tile_size.pmax)")
        if t.on_chip and not self.name.startswith(("dma", "nc_", "register", "sendrecv")):
            from .. import cost

            limit = cost.ENGINE_PSUM_FMAX if t.buffer is psum else cost.ENGINE_SBUF_FMAX
            free = math.prod(t.shape[1:])
            if free > limit:
                self.fail(f"{role} has {free} elements per partition; an engine instruction reads at most {limit} "
                          f"from {buffer_label(t.buffer)}")
        if t.dtype in _dtypes.PACKED and self.name not in ("dma_copy", "memset", "tensor_copy"):
            self.fail(f"{role} has the packed MX type {_dtypes.name(t.dtype)}: NeuronCore-v4 only")
        self.operands.append((role, t, write))
        return t

    def pf(self, t):
        return (t.shape[0], math.prod(t.shape[1:])) if t.ndim else (1, 1)

    def same_pf(self, role_a, a, role_b, b):
        pa, pb = self.pf(a), self.pf(b)
        if pa[0] != pb[0]:
            self.fail(f"{role_a} has {pa[0]} partitions but {role_b} has {pb[0]} (shapes {a.shape} and {b.shape})")
        if pa[1] != pb[1]:
            self.fail(f"{role_a} has {pa[1]} elements per partition but {role_b} has {pb[1]} "
                      f"(shapes {a.shape} and {b.shape})")

    def read(self, t, f32=True):
        values = t.read(self.name)
        p, n = self.pf(t)
        values = np.asarray(values).reshape(p, n)
        if t.buffer is psum:
            _psum_read(t)
        return _dtypes.to_f32(values) if f32 else values

    def write(self, t, values, mask=None):
        t.write(np.asarray(values).reshape(t.shape) if np.size(values) == t.size else values, self.name, mask=mask)
        if t.buffer is psum:
            _psum_state(t)[...] = 0

    def scalar_or_vector(self, role, x, partitions, allow_none=False):
        """A compile-time scalar, or a (P, 1) tile read per partition, as float32 (P, 1) or scalar."""
        if x is None:
            if allow_none:
                return None
            self.fail(f"{role} is required")
        if isinstance(x, NkiTensor):
            self.tile(role, x)
            p, n = self.pf(x)
            if p != partitions or n != 1:
                self.fail(f"{role} must be a scalar or a ({partitions}, 1) tile, got shape {x.shape}")
            return self.read(x)
        if isinstance(x, VirtualRegister):
            return np.float32(x.value)
        try:
            return np.float32(x)
        except (TypeError, ValueError):
            self.fail(f"{role} must be a number or an NkiTensor, got {x!r}")

    def engine(self, requested, default="VectorE", allowed=("VectorE",)):
        if isinstance(requested, engine) and requested is not engine.unknown:
            name = _ENGINE_NAMES[requested]
            if name not in allowed:
                self.fail(f"engine={requested} is not available for {self.name} (allowed: {', '.join(allowed)})")
            return name
        return default

    def check_gpsimd_psum(self, eng):
        if eng == "GpSimd":
            for role, t, _ in self.operands:
                if t.buffer is psum:
                    self.fail(f"{role} is in PSUM, which the GpSimd engine cannot access")

    def record(self, eng, **info):
        tensors = [t for _, t, _ in self.operands]
        nbytes = sum(t.size * t.itemsize for t in tensors)
        elements = max((self.pf(t)[1] for t in tensors if t.on_chip), default=1)
        partitions = max((t.shape[0] for t in tensors if t.on_chip and t.ndim), default=1)
        on_chip = [t for t in tensors if t.on_chip]
        info.setdefault("all_sbuf", all(t.buffer is sbuf for t in on_chip))
        info.setdefault("one_psum", sum(t.buffer is psum for _, t, w in self.operands if not w) == 1)
        info.setdefault("contiguous", all(t.ndim and t.strides[-1] == 1 for t in on_chip))
        location = user_frame(2)
        ins = Instruction(
            name=self.name, engine=eng, shapes=tuple(t.shape for t in tensors),
            dtypes=tuple(_dtypes.name(t.dtype) for t in tensors), bytes=info.pop("nbytes", nbytes),
            line=f"{location[0]}:{location[1]}", partitions=partitions, elements=info.pop("elements", elements),
            reads=tuple(t.access_rect() for _, t, w in self.operands if not w),
            writes=tuple(t.access_rect() for _, t, w in self.operands if w), info=info)
        self.program.record(ins)
        return NkiInstruction(ins)


def _named(t):
    return f" ('{t.name}')" if t.name else ""


# PSUM accumulation state, one value per element: 0 = not written by a matmul, 1 = written by a
# matmul and still accumulating, 2 = written by a matmul and read since (a new group starts).
def _psum_state(t: NkiTensor) -> np.ndarray:
    storage = t.storage
    if storage.shadow is None:
        storage.shadow = np.zeros(storage.data.size, dtype=np.uint8)
    if t.is_indirect():
        return np.zeros(t.shape, dtype=np.uint8)
    kind = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.itemsize]
    return np.ndarray(t.shape, dtype=kind, buffer=storage.shadow, offset=t.offset * t.itemsize,
                      strides=tuple(s * t.itemsize for s in t.strides))


def _psum_read(t: NkiTensor):
    state = _psum_state(t)
    state[state == 1] = 2


def _flat_pf(values, p):
    return np.asarray(values).reshape(p, -1)


def _ret(call, eng, **info):
    return call.record(eng, **info)


# -- data movement -----------------------------------------------------------------------------------


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """``dst = src`` by the DMA engines, between HBM and SBUF, casting through float32."""
    from ..tensor import private_hbm, shared_hbm

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
    from ..tensor import private_hbm, shared_hbm

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


# -- Tensor Engine -------------------------------------------------------------------------------------


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


# -- elementwise ------------------------------------------------------------------------------------------


def _binary(op: Op, a, b, dtypes_int: bool):
    if op.bitvec:
        return op.fn(a, b)
    with np.errstate(all="ignore"):
        return op.apply(a, b)


def _is_int_tile(t):
    return _dtypes.is_int(t.dtype)


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


def _apply_scalar(op, data, operand, reverse):
    if op is None or op.name == "bypass":
        return data
    if op.arity == 1:
        with np.errstate(all="ignore"):
            return op.apply(data)
    with np.errstate(all="ignore"):
        return op.apply(operand, data) if reverse else op.apply(data, operand)


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


def _accumulator(program, engine_name):
    return program.scalar_acc if engine_name == "ScalarE" else program.vector_acc


def _reduce_rows(op, values):
    return op.reduce(values) if op.name != "average" else values.mean(axis=1)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """``dst = op(data * scale + bias)`` on the Scalar Engine, with an optional free-axis reduction
    into the engine's accumulator registers (``reduce_cmd``) read out into ``reduce_res``."""
    return _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd)


def _activation(name, dst, op, data, bias, scale, reduce_op, reduce_res, cmd, relu_param=0.0):
    c = _Call(name)
    c.tile("dst", dst, write=True)
    c.tile("data", data, why="compute engines read SBUF/PSUM only; use nisa.dma_copy for HBM")
    c.same_pf("dst", dst, "data", data)
    op = as_op(op, name)
    if op.arity != 1:
        c.fail(f"op={op!r} is not an activation function (see the activation table: nl.exp, nl.copy, ...)")
    if op.bitvec:
        c.fail(f"op={op!r} is a bitvec operator, not an activation function")
    p = data.shape[0]
    s = c.scalar_or_vector("scale", scale, p)
    b = c.scalar_or_vector("bias", bias, p, allow_none=True)
    x = c.read(data)
    with np.errstate(all="ignore"):
        z = x * s if not (np.isscalar(s) and s == 1.0) else x
        if b is not None:
            z = z + b
        out = op.apply(np.asarray(z, np.float32), relu_param=relu_param)
    out = np.asarray(out, dtype=np.float32)
    acc = c.program.scalar_acc
    if reduce_op is not None or cmd is not reduce_cmd.idle or reduce_res is not None:
        rop = as_op(reduce_op, name, "reduce_op") if reduce_op is not None else OPS["add"]
        if rop.name != "add":
            c.fail(f"reduce_op must be nl.add on NeuronCore-v3, got {rop!r}")
        if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
            acc[:p] = 0
        if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
            acc[:p] = acc[:p] + _reduce_rows(rop, _dtypes.to_f32(_dtypes.cast(out, dst.dtype)))
        if reduce_res is not None:
            c.tile("reduce_res", reduce_res, write=True)
            if reduce_res.shape[0] != p or c.pf(reduce_res)[1] != 1:
                c.fail(f"reduce_res must be ({p}, 1), got {reduce_res.shape}")
    c.write(dst, out)
    if reduce_res is not None:
        c.write(reduce_res, acc[:p].reshape(p, 1))
    return c.record("ScalarE", op=op.name, reads_accumulator=reduce_res is not None)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd.reset_reduce``: the free-axis reduction of the result goes
    to ``reduce_res``."""
    return _activation("activation_reduce", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd.reset_reduce)


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None,
              reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None):
    fail("activate2", "activate2 is available on NeuronCore-v4 (Trn3) only; the simulator models NeuronCore-v3")


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None):
    fail("exponential", "nisa.exponential is available on NeuronCore-v4 (Trn3) only; the simulator models "
         "NeuronCore-v3 (use nisa.activation(op=nl.exp, bias=-max))")


def rand2(dst, min, max, name=None):
    fail("rand2", "nisa.rand2 is available on NeuronCore-v4 (Trn3) only")


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


# -- GpSimd patterns and selection -------------------------------------------------------------------------


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


# -- statistics, top-8, gathers -----------------------------------------------------------------------


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


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None):
    """``dst = sum(srcs[i] * scales[i])`` computed by the DMA engines (float32)."""
    from ..tensor import private_hbm, shared_hbm

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


# -- registers, synchronisation ---------------------------------------------------------------------------


def register_alloc(x=None):
    """A virtual register, optionally initialised with an integer."""
    c = _Call("register_alloc")
    reg = VirtualRegister(x)
    c.record("Sync")
    return reg


def register_move(dst, src):
    c = _Call("register_move")
    if not isinstance(dst, VirtualRegister) or dst.frozen:
        c.fail("dst must be a writable VirtualRegister")
    dst.value = int(src.value if isinstance(src, VirtualRegister) else src)
    return c.record("Sync")


def register_load(dst, src):
    """Load a one-element SBUF/HBM tensor into a register."""
    from ..tensor import private_hbm, shared_hbm

    c = _Call("register_load")
    if not isinstance(dst, VirtualRegister) or dst.frozen:
        c.fail("dst must be a writable VirtualRegister")
    c.tile("src", src, (sbuf, private_hbm, shared_hbm))
    if src.size != 1:
        c.fail(f"src must hold exactly one element, got shape {src.shape}")
    value = np.asarray(src.read(c.name)).reshape(-1)[0]
    dst.value = int(value)
    return c.record("Sync")


def register_store(dst, src):
    from ..tensor import private_hbm, shared_hbm

    c = _Call("register_store")
    c.tile("dst", dst, (sbuf, private_hbm, shared_hbm), write=True)
    if dst.size != 1:
        c.fail(f"dst must hold exactly one element, got shape {dst.shape}")
    dst.write(np.full(dst.shape, int(src.value if isinstance(src, VirtualRegister) else src), dtype=np.int64), c.name)
    return c.record("Sync")


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Wait until every core of the launch reaches this barrier (LNC2)."""
    c = _Call("core_barrier")
    shared = c.program.shared
    if shared.barrier is not None:
        shared.barrier.wait()
    return c.record(c.engine(engine, "GpSimd", ("GpSimd", "VectorE", "ScalarE", "TensorE", "Sync")))


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None):
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving ``recv_from_rank``'s ``src``."""
    c = _Call("sendrecv")
    c.tile("src", src, (sbuf,))
    c.tile("dst", dst, (sbuf,), write=True)
    if src.dtype != dst.dtype or src.shape != dst.shape:
        c.fail(f"src and dst must have the same dtype and shape ({src.shape} {_dtypes.name(src.dtype)}, "
               f"{dst.shape} {_dtypes.name(dst.dtype)})")
    shared = c.program.shared
    me = c.program.index
    if shared.nprograms == 1:
        if int(send_to_rank) != 0 or int(recv_from_rank) != 0:
            c.fail("sendrecv needs an LNC2 launch (kernel[2]) to reach another core")
        c.write(dst, c.read(src, f32=False))
    else:
        payload = np.array(src.read(c.name), copy=True)
        with shared.cond:
            shared.pipes.setdefault((int(pipe_id), me, int(send_to_rank)), []).append(payload)
            shared.cond.notify_all()
            key = (int(pipe_id), int(recv_from_rank), me)
            if not shared.cond.wait_for(lambda: shared.pipes.get(key), timeout=60):
                c.fail(f"sendrecv: nothing received from core {recv_from_rank} on pipe {pipe_id} (deadlock)")
            received = shared.pipes[key].pop(0)
        dst.write(received, c.name)
    return c.record("DMA", nbytes=src.size * src.itemsize, rows=src.shape[0])


# -- target -------------------------------------------------------------------------------------------------


def get_nc_version():
    """The simulated target: NeuronCore-v3 (Trn2)."""
    return nc_version.gen3


def get_nc_sub_version():
    return 0


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "math", "np")]
