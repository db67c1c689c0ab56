"""RMSNorm and rotary embeddings (RoPE) as NKI kernels, forward and backward.

- ``rms_norm_fwd(x [N, D], w [D], eps) -> y [N, D]``: ``y = x * rstd * w`` with
  ``rstd = rsqrt(mean(x^2) + eps)``, computed in float32, rounded once to x's dtype.
- ``rms_norm_bwd(g, x, w, eps) -> (dx [N, D], dw [D])``: ``rstd`` recomputed (one more pass
  over x on the Scalar Engine instead of a tensor kept from the forward pass),
  ``dx = rstd * (g*w - xhat * mean(g*w*xhat))``, ``dw = sum_rows(g * xhat)``, ``xhat = x * rstd``;
  the row sums of ``dw`` on the Tensor Engine (a matmul with a column of ones).
- ``rope(x [B, H, S, Dh], cos, sin [Bc, S, Dh], inverse)``: the rotate-half convention of Hugging
  Face's Llama (``x * cos + rotate_half(x) * sin``; cos/sin repeat their first half); ``inverse``
  rotates by the opposite angle, which is RoPE's backward.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ._tiles import FMAX, P, column, hbm, load, load_rows, psum, sbuf, spans


def _rstd(xt, eps):
    """rsqrt(mean(x^2) + eps) of each row of a float32 tile."""
    rows, d = xt.shape
    squares = sbuf((rows, d))
    total = sbuf((rows, 1))
    nisa.activation_reduce(dst=squares, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=total)
    r = sbuf((rows, 1))
    nisa.tensor_scalar(dst=r, data=total, op0=nl.multiply, operand0=1.0 / d, op1=nl.add, operand1=eps)
    nisa.activation(dst=r, op=nl.rsqrt, data=r)
    return r


@nki.jit
def rms_norm_fwd(x, w, eps):
    n, d = x.shape
    y = hbm((n, d), x.dtype)
    weight = load_rows(w, min(n, P), name="w")
    for r0, rows in spans(n, P):
        xt = load(x[r0:r0 + rows, :], name="x")
        r = _rstd(xt, eps)
        nisa.tensor_scalar(dst=xt, data=xt, op0=nl.multiply, operand0=r)
        out = sbuf((rows, d), x.dtype)
        nisa.tensor_tensor(dst=out, data1=xt, data2=weight[:rows], op=nl.multiply)
        nisa.dma_copy(dst=y[r0:r0 + rows, :], src=out)
    return y


@nki.jit
def rms_norm_bwd(g, x, w, eps):
    n, d = x.shape
    dx = hbm((n, d), x.dtype)
    dw = hbm((d,), w.dtype)
    weight = load_rows(w, min(n, P), name="w")
    dw_acc = sbuf((1, d), name="dw")
    nisa.memset(dst=dw_acc, value=0.0)
    for r0, rows in spans(n, P):
        xt = load(x[r0:r0 + rows, :], name="x")
        gt = load(g[r0:r0 + rows, :], name="g")
        r = _rstd(xt, eps)
        nisa.tensor_scalar(dst=xt, data=xt, op0=nl.multiply, operand0=r)  # xhat
        gw = sbuf((rows, d))
        nisa.tensor_tensor(dst=gw, data1=gt, data2=weight[:rows], op=nl.multiply)
        prod = sbuf((rows, d))
        mean = sbuf((rows, 1))
        nisa.tensor_tensor(dst=prod, data1=gw, data2=xt, op=nl.multiply)
        nisa.tensor_reduce(dst=mean, op=nl.add, data=prod, axis=1)
        nisa.tensor_scalar(dst=mean, data=mean, op0=nl.multiply, operand0=1.0 / d)
        # dx = (gw - xhat * mean) * rstd
        nisa.tensor_scalar(dst=prod, data=xt, op0=nl.multiply, operand0=mean)
        nisa.tensor_tensor(dst=gw, data1=gw, data2=prod, op=nl.subtract)
        out = sbuf((rows, d), x.dtype)
        nisa.tensor_scalar(dst=out, data=gw, op0=nl.multiply, operand0=r)
        nisa.dma_copy(dst=dx[r0:r0 + rows, :], src=out)
        # dw += ones[rows].T @ (g * xhat): the sum over the rows on the Tensor Engine
        nisa.tensor_tensor(dst=prod, data1=gt, data2=xt, op=nl.multiply)
        ones = column(rows, 1.0)
        for c0, cols in spans(d, FMAX):
            part = psum((1, cols))
            nisa.nc_matmul(dst=part, stationary=ones, moving=prod[:, c0:c0 + cols])
            nisa.tensor_tensor(dst=dw_acc[:, c0:c0 + cols], data1=dw_acc[:, c0:c0 + cols], data2=part, op=nl.add)
    nisa.dma_copy(dst=dw.reshape((1, d)), src=dw_acc)
    return dx, dw


@nki.jit
def rope(x, cos, sin, inverse):
    b, h, s, dh = x.shape
    half = dh // 2
    out = hbm((b, h, s, dh), x.dtype)
    for bi in range(b):
        cb = bi if cos.shape[0] > 1 else 0
        for s0, rows in spans(s, P):
            c = load(cos[cb, s0:s0 + rows, 0:half], name="cos")
            sn = load(sin[cb, s0:s0 + rows, 0:half], name="sin")
            for hi in range(h):
                xt = load(x[bi, hi, s0:s0 + rows, :], name="x")
                x1, x2 = xt[:, 0:half], xt[:, half:dh]
                a = sbuf((rows, half))
                bb = sbuf((rows, half))
                o = sbuf((rows, dh), x.dtype)
                # out1 = x1*cos -/+ x2*sin ; out2 = x2*cos +/- x1*sin
                nisa.tensor_tensor(dst=a, data1=x1, data2=c, op=nl.multiply)
                nisa.tensor_tensor(dst=bb, data1=x2, data2=sn, op=nl.multiply)
                nisa.tensor_tensor(dst=o[:, 0:half], data1=a, data2=bb, op=nl.add if inverse else nl.subtract)
                nisa.tensor_tensor(dst=a, data1=x2, data2=c, op=nl.multiply)
                nisa.tensor_tensor(dst=bb, data1=x1, data2=sn, op=nl.multiply)
                nisa.tensor_tensor(dst=o[:, half:dh], data1=a, data2=bb, op=nl.subtract if inverse else nl.add)
                nisa.dma_copy(dst=out[bi, hi, s0:s0 + rows, :], src=o)
    return out
