"""Scalar Engine instructions: activation functions with scale, bias and accumulator reduction."""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from .._ops import as_op, OPS
from .._state import fail
from .constants import reduce_cmd
from ._call import _Call, _reduce_rows


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
