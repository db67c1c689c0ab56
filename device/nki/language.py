"""``nki.language``: tensors, buffers, dtypes, loops, and the high-level functions.

The reference is ``nki/api/nki/language/__init__.py`` of aws-neuron-sdk. The high-level functions
(``nl.add(a, b)``, ``nl.exp(x)``, ``nl.matmul``, ``nl.load``, ``nl.softmax`` ...) allocate their
result and run the ISA instructions they lower to (each recorded in the trace as that instruction).
"""
from __future__ import annotations

import contextlib
import math
import sys

import numpy as np

from . import _dtypes
from . import isa as _isa
from ._dtypes import (bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4, float8_e5m2,
                      float8_e5m2_x4, float8_e8m0fnu, float16, float32, int8, int16, int32, tfloat32, uint8, uint16,
                      uint32)
from ._ops import OPS
from ._state import NkiValidationError, current, fail
from .tensor import (NKIObject, MemoryRegion, NkiTensor, DynamicSlice, allocate, ds, from_numpy, hbm, is_hbm,
                     is_on_chip, is_psum, is_sbuf, private_hbm, psum, sbuf, shared_hbm)
from . import cost as _cost

tensor = NkiTensor  # annotation alias used by kernels (``nl.tensor``)
bool = bool_  # noqa: A001  (``nl.bool`` in older kernels)


class _TileSize(NKIObject):
    """Hardware tile size constants of NeuronCore-v3 (``nl.tile_size``)."""

    pmax = _cost.PMAX
    psum_fmax = _cost.PSUM_FMAX
    psum_bank_fmax = _cost.PSUM_FMAX
    psum_bank_fmax_bytes = _cost.PSUM_BANK_BYTES
    gemm_stationary_fmax = _cost.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = _cost.GEMM_MOVING_FMAX
    bn_stats_fmax = _cost.BN_STATS_FMAX
    psum_min_align = 4  # assumption: one float32 (not published)
    sbuf_min_align = 1  # assumption (not published)

    @property
    def psum_num_banks(self) -> int:
        return _cost.PSUM_BYTES_PER_PARTITION // _cost.PSUM_BANK_BYTES

    @property
    def sbuf_size_bytes(self) -> int:
        return 128 * _cost.SBUF_BYTES_PER_PARTITION

    @property
    def sbuf_fmax_bytes(self) -> int:
        return _cost.SBUF_USABLE_BYTES_PER_PARTITION

    @property
    def sbuf_fmax(self) -> int:
        return self.sbuf_fmax_bytes // 4

    @property
    def total_available_sbuf_size(self) -> int:
        return _cost.SBUF_USABLE_BYTES_PER_PARTITION


tile_size = _TileSize()

# operator constants; the ones that are also functions get their bodies below
for _name, _op in OPS.items():
    globals()[_name] = _op
prelu = OPS["prelu"]
bypass = OPS["bypass"]
average = OPS["average"]


def _language(name):
    def deco(fn):
        op = OPS[name]
        op.language = fn
        op.__doc__ = fn.__doc__
        return op

    return deco


# -- creation -------------------------------------------------------------------------------------------


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """A new tensor (uninitialised: the simulator fills NaN, or 4 for integers)."""
    return allocate(shape, dtype, buffer, name, address, "nl.ndarray")


def _filled(shape, value, dtype, buffer, name, what):
    t = allocate(shape, dtype, buffer, name, None, what)
    if is_hbm(t.buffer):
        t.write(np.full(t.shape, value), what)
    else:
        _isa.memset(t, value)
    return t


def zeros(shape, dtype, buffer=sbuf, name=""):
    """A new tensor filled with zeros (a ``memset`` on chip)."""
    return _filled(shape, 0, dtype, buffer, name, "nl.zeros")


def ones(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, 1, dtype, buffer, name, "nl.ones")


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    return _filled(shape, fill_value, dtype, buffer, name, "nl.full")


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def rand(shape, dtype=float32, buffer=sbuf, name=""):
    """Uniform [0, 1) values (Vector Engine PRNG)."""
    t = allocate(shape, dtype, buffer, name, None, "nl.rand")
    program = current("nl.rand")
    t.write(program.rng.random(t.shape, dtype=np.float32), "nl.rand")
    c = _isa._Call("rng")
    c.tile("dst", t, write=True)
    c.record("VectorE")
    return t


def random_seed(seed):
    _isa.set_rng_seed(seed)


def shared_constant(constant):
    """A shared-HBM tensor holding ``constant`` (a numpy array or a ``.npy`` path), loaded with the model."""
    array = np.load(constant) if isinstance(constant, str) else np.ascontiguousarray(constant)
    current("nl.shared_constant")
    return from_numpy(np.array(array, copy=True), shared_hbm)


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An n x n identity in SBUF (a constant the compiler shares; loaded by one DMA)."""
    eye = np.eye(int(n), dtype=np.float32)
    const = from_numpy(_dtypes.cast(eye, _dtypes.as_dtype(dtype)).copy(), shared_hbm)
    if dst is None:
        dst = allocate((int(n), int(n)), dtype, sbuf, "identity", None, "nl.shared_identity_matrix")
    _isa.dma_copy(dst, const)
    return dst


# -- data movement ------------------------------------------------------------------------------------------


def load(src, dtype=None):
    """An SBUF copy of an HBM tensor (one ``dma_copy``)."""
    if not isinstance(src, NkiTensor):
        fail("nl.load", f"src must be an NkiTensor, got {type(src).__name__}")
    dst = allocate(src.shape if src.ndim >= 2 else (1,) + src.shape, dtype or src.dtype, sbuf, "", None, "nl.load")
    _isa.dma_copy(dst, src)
    return dst


def store(dst, value):
    """Write an on-chip tile to HBM (one ``dma_copy``)."""
    if isinstance(value, NkiTensor) and value.buffer is psum:
        tmp = allocate(value.shape, value.dtype, sbuf, "", None, "nl.store")
        _isa.tensor_copy(tmp, value)
        value = tmp
    _isa.dma_copy(dst, value)


def load_transpose2d(src, dtype=None):
    dst = allocate((src.shape[1], src.shape[0]), dtype or src.dtype, sbuf, "", None, "nl.load_transpose2d")
    _isa.dma_transpose(dst, src)
    return dst


@_language("copy")
def copy(x, dtype=None):
    """An SBUF copy of a tile (``tensor_copy``)."""
    dst = allocate(x.shape, dtype or x.dtype, sbuf, "", None, "nl.copy")
    _isa.tensor_copy(dst, x)
    return dst


def matmul(x, y, transpose_x=False):
    """``x @ y`` (or ``x.T @ y``): a PSUM float32 tile (``nc_matmul``, after an ``nc_transpose`` of x
    unless ``transpose_x``)."""
    if not transpose_x:
        xt_psum = allocate((x.shape[1], x.shape[0]), x.dtype, psum, "", None, "nl.matmul")
        _isa.nc_transpose(xt_psum, x)
        xt = allocate(xt_psum.shape, x.dtype, sbuf, "", None, "nl.matmul")
        _isa.tensor_copy(xt, xt_psum)
        x = xt
    out = allocate((x.shape[1],) + tuple(y.shape[1:]), float32, psum, "", None, "nl.matmul")
    _isa.nc_matmul(out, x, y)
    return out


def transpose(x, dtype=None):
    """The 2-D transpose of a tile (``nc_transpose`` into PSUM)."""
    out = allocate((math.prod(x.shape[1:]), x.shape[0]), dtype or x.dtype, psum, "", None, "nl.transpose")
    _isa.nc_transpose(out, x)
    return out


# -- element-wise ----------------------------------------------------------------------------------------------


def _is_tile(v):
    return isinstance(v, NkiTensor)


def _result(shape, dtype, what):
    return allocate(shape, dtype, sbuf, "", None, what)


def _per_partition(t: NkiTensor) -> bool:
    return math.prod(t.shape[1:]) == 1


def _broadcast_view(t: NkiTensor, shape):
    if t.shape == tuple(shape):
        return t
    if len(t.shape) != len(shape):
        fail("nl (broadcast)", f"cannot broadcast {t.shape} to {tuple(shape)}")
    v = t
    for d, (a, b) in enumerate(zip(t.shape, shape)):
        if a != b:
            if a != 1 or d == 0:
                fail("nl (broadcast)", f"cannot broadcast {t.shape} to {tuple(shape)}")
            v = v.broadcast(d, b)
    return v


def _binary_fn(name):
    op = OPS[name]

    def fn(x, y, dtype=None):
        what = f"nl.{name}"
        if not _is_tile(x) and not _is_tile(y):
            fail(what, "at least one of x, y must be a tile")
        if _is_tile(x) and _is_tile(y):
            shape = np.broadcast_shapes(x.shape, y.shape)
            out = _result(shape, dtype or x.dtype, what)
            if _per_partition(y) and x.shape == tuple(shape):
                _isa.tensor_scalar(out, x, op, y)
            elif _per_partition(x) and y.shape == tuple(shape):
                _isa.tensor_scalar(out, y, op, x, reverse0=True)
            else:
                _isa.tensor_tensor(out, _broadcast_view(x, shape), _broadcast_view(y, shape), op)
            return out
        if _is_tile(x):
            out = _result(x.shape, dtype or x.dtype, what)
            _isa.tensor_scalar(out, x, op, y)
        else:
            out = _result(y.shape, dtype or y.dtype, what)
            _isa.tensor_scalar(out, y, op, x, reverse0=True)
        return out

    fn.__name__ = name
    fn.__doc__ = f"``nl.{name}(x, y)`` element-wise (``tensor_tensor``, or ``tensor_scalar`` for a scalar or a (P, 1) operand)."
    op.language = fn
    return op


for _name in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "fmod", "mod", "abs_max",
              "abs_min", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_and",
              "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"):
    globals()[_name] = _binary_fn(_name)


def _unary_fn(name):
    op = OPS[name]

    def fn(x, dtype=None):
        what = f"nl.{name}"
        if not _is_tile(x):
            fail(what, f"x must be a tile, got {type(x).__name__}")
        out = _result(x.shape, dtype or x.dtype, what)
        if op.activation and name not in ("abs", "reciprocal", "sin"):
            _isa.activation(out, op, x)
        elif name == "reciprocal":
            _isa.reciprocal(out, x)
        elif name == "sin":  # nl.sin range-reduces before the activation (nki.api.shared.rst)
            _isa.tensor_scalar(out, x, OPS["add"], np.float32(np.pi), op1=OPS["mod"], operand1=np.float32(2 * np.pi))
            _isa.tensor_scalar(out, out, OPS["subtract"], np.float32(np.pi))
            _isa.activation(out, op, out)
        else:
            _isa.tensor_scalar(out, x, op, None)
        return out

    fn.__name__ = name
    fn.__doc__ = f"``nl.{name}(x)`` element-wise."
    op.language = fn
    return op


for _name in ("abs", "square", "relu", "rsqrt", "reciprocal", "negative", "sign", "exp", "log", "sqrt", "tanh",
              "sigmoid", "gelu", "gelu_dx", "gelu_apprx_tanh", "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx", "silu",
              "silu_dx", "softplus", "mish", "erf", "erf_dx", "sin", "cos", "tan", "arctan", "ceil", "floor", "trunc",
              "invert", "logical_not"):
    globals()[_name] = _unary_fn(_name)


# -- reductions ---------------------------------------------------------------------------------------------------


def _axes(x, axis):
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    return sorted(a + x.ndim if a < 0 else a for a in axes)


def _reduce_fn(name, opname):
    def fn(x, axis, dtype=None, keepdims=False):
        what = f"nl.{name}"
        axes = _axes(x, axis)
        shape = [n for d, n in enumerate(x.shape) if d not in axes or keepdims]
        shape = [1 if d in axes else n for d, n in enumerate(x.shape)] if keepdims else shape
        if len(shape) < 2:
            shape = list(shape) + [1]
        out = _result(tuple(shape), dtype or x.dtype, what)
        _isa.tensor_reduce(out, OPS[opname], x, axes, keepdims=keepdims)
        if name == "mean":
            n = math.prod(x.shape[a] for a in axes)
            _isa.tensor_scalar(out, out, OPS["multiply"], 1.0 / n)
        return out

    fn.__name__ = name
    fn.__doc__ = f"``nl.{name}(x, axis)``: a ``tensor_reduce`` over the last free axes."
    return fn


sum = _reduce_fn("sum", "add")  # noqa: A001
prod = _reduce_fn("prod", "multiply")
mean = _reduce_fn("mean", "add")
all = _reduce_fn("all", "logical_and")  # noqa: A001
OPS["max"].language = _reduce_fn("max", "maximum")
OPS["min"].language = _reduce_fn("min", "minimum")
max = OPS["max"]  # noqa: A001  (nl.max(x, axis) reduces; as op= it is nl.maximum)
min = OPS["min"]  # noqa: A001


def var(x, axis, dtype=None, keepdims=False):
    """Variance over the last free axes (keepdims shape, as documented)."""
    axes = _axes(x, axis)
    m = mean(x, axes, dtype=float32, keepdims=True)
    centered = _result(x.shape, float32, "nl.var")
    _isa.tensor_scalar(centered, x, OPS["subtract"], m) if _per_partition(m) else \
        _isa.tensor_tensor(centered, x, _broadcast_view(m, x.shape), OPS["subtract"])
    _isa.tensor_tensor(centered, centered, centered, OPS["multiply"])
    out = mean(centered, axes, dtype=dtype or x.dtype, keepdims=True)
    return out


def softmax(x, axis=-1, dtype=None):
    """``exp(x - max) / sum(exp(x - max))`` along the free axis."""
    p = x.shape[0]
    mx = _result((p, 1), float32, "nl.softmax")
    _isa.tensor_reduce(mx, OPS["maximum"], x, _axes(x, axis), negate=True)
    e = _result(x.shape, float32, "nl.softmax")
    s = _result((p, 1), float32, "nl.softmax")
    _isa.activation(e, OPS["exp"], x, bias=mx, reduce_op=OPS["add"], reduce_res=s,
                    reduce_cmd=_isa.reduce_cmd.reset_reduce)
    r = _result((p, 1), float32, "nl.softmax")
    _isa.reciprocal(r, s)
    out = _result(x.shape, dtype or x.dtype, "nl.softmax")
    _isa.tensor_scalar(out, e, OPS["multiply"], r)
    return out


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None):
    """``x / sqrt(mean(x^2) + eps) * w``."""
    p = x.shape[0]
    sq = _result(x.shape, float32, "nl.rms_norm")
    ss = _result((p, 1), float32, "nl.rms_norm")
    _isa.activation(sq, OPS["square"], x, reduce_op=OPS["add"], reduce_res=ss, reduce_cmd=_isa.reduce_cmd.reset_reduce)
    _isa.tensor_scalar(ss, ss, OPS["multiply"], 1.0 / n, op1=OPS["add"], operand1=epsilon)
    _isa.activation(ss, OPS["rsqrt"], ss)
    out = _result(x.shape, dtype or x.dtype, "nl.rms_norm")
    _isa.tensor_scalar(out, x, OPS["multiply"], ss)
    _isa.tensor_tensor(out, out, _broadcast_view(w, x.shape), OPS["multiply"])
    return out


def where(condition, x, y, dtype=None):
    """``x`` where ``condition`` (1.0/0.0) else ``y``."""
    shape = condition.shape
    out = _result(shape, dtype or (x.dtype if _is_tile(x) else float32), "nl.where")
    pred = _result(shape, uint8, "nl.where")
    _isa.tensor_scalar(pred, condition, OPS["not_equal"], 0.0)
    if _is_tile(y):
        _isa.tensor_copy(out, _broadcast_view(y, shape))
    else:
        _isa.memset(out, y)
    if _is_tile(x):
        _isa.tensor_copy_predicated(out, _broadcast_view(x, shape), pred)
    else:
        _isa.tensor_copy_predicated(out, x, pred)
    return out


def dropout(x, rate, dtype=None):
    out = _result(x.shape, dtype or x.dtype, "nl.dropout")
    _isa.dropout(out, x, rate)
    return out


def expand_dims(x, axis):
    """A view with a size-1 axis inserted."""
    return x.expand_dim(axis)


def broadcast_to(x, shape, dtype=None):
    """A tile of ``shape`` holding ``x`` broadcast (a ``tensor_copy`` of a broadcast view)."""
    if tuple(shape) == x.shape and (dtype is None or dtype == x.dtype):
        return x
    out = _result(tuple(shape), dtype or x.dtype, "nl.broadcast_to")
    _isa.tensor_copy(out, _broadcast_view(x, shape))
    return out


def gather_flattened(data, indices, axis=0, dtype=None):
    out = _result(indices.shape, dtype or data.dtype, "nl.gather_flattened")
    _isa.nc_n_gather(out, data, indices)
    return out


# -- loops, programs ------------------------------------------------------------------------------------------------


def affine_range(start, stop=None, step=1):
    """``range`` (the simulator runs every loop sequentially, in Python)."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def _int(v):
    return int(v.value) if isinstance(v, _isa.VirtualRegister) else int(v)


def dynamic_range(start, stop=None, step=1):
    """A loop run on the device with (possibly register) bounds; simulated as ``range``."""
    if stop is None:
        return range(_int(start))
    return range(_int(start), _int(stop), int(step))


def fori_loop(lower, upper, body_fun, step=1):
    for i in range(_int(lower), _int(upper), int(step)):
        body_fun(_isa.VirtualRegister(i, frozen=True))


def while_loop(init, body_fun):
    reg = init
    while _int(reg) != 0:
        reg = body_fun(reg)


def program_id(axis=0):
    program = current("nl.program_id")
    if not program.grid:
        return 0
    return program.program_id[axis]


def num_programs(axes=None):
    program = current("nl.num_programs")
    if not program.grid:
        return 1
    if axes is None:
        return math.prod(program.grid)
    if isinstance(axes, (tuple, list)):
        return math.prod(program.grid[a] for a in axes)
    return program.grid[axes]


def program_ndim():
    return len(current("nl.program_ndim").grid)


def device_print(print_prefix, tensor):
    """Print a tensor's values now (the simulator's behaviour)."""
    print(print_prefix, np.asarray(tensor.read("nl.device_print")), file=sys.stdout)


@contextlib.contextmanager
def no_reorder():
    yield


def par_dim(n):
    """Legacy ``nl.par_dim(n)`` marker: the partition dimension is simply the first one."""
    return n


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "contextlib", "math", "np", "sys")]
