"""What every instruction shares: operand checks, the trace record, PSUM accumulation state, registers."""
from __future__ import annotations

import math

import numpy as np

from .. import _dtypes
from .._ops import Op
from .._state import Instruction, NkiValidationError, current, user_frame, where
from ..tensor import NKIObject, NkiTensor, buffer_label, psum, sbuf
from .constants import engine


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


class _Call:
    """One instruction being executed: operand checks, then the trace record."""

    def __init__(self, name: str):
        self.name = name
        self.program = current(f"nisa.{name}")
        self.operands = []  # (role, tensor, written)

    def fail(self, message):
        location = user_frame(2)
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


def _binary(op: Op, a, b, dtypes_int: bool):
    if op.bitvec:
        return op.fn(a, b)
    with np.errstate(all="ignore"):
        return op.apply(a, b)


def _is_int_tile(t):
    return _dtypes.is_int(t.dtype)


def _apply_scalar(op, data, operand, reverse):
    if op is None or op.name == "bypass":
        return data
    if op.arity == 1:
        with np.errstate(all="ignore"):
            return op.apply(data)
    with np.errstate(all="ignore"):
        return op.apply(operand, data) if reverse else op.apply(data, operand)


def _accumulator(program, engine_name):
    return program.scalar_acc if engine_name == "ScalarE" else program.vector_acc


def _reduce_rows(op, values):
    return op.reduce(values) if op.name != "average" else values.mean(axis=1)
