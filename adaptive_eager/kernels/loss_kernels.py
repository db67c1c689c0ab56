"""Cross-entropy as NKI kernels, forward and backward.

- ``cross_entropy_fwd(logits [N, V], target [N] int32 (or [N, 2] int32: an int64 target's
  words, the low one read), ignore_index) -> (loss [1], lse [N], count [1])``, float32: per 128-row tile, the log-sum-exp over V in 4096-column chunks (an
  online max and sum), the target's logit picked by comparing a column index with the target;
  ``loss`` is the mean over the rows whose target is not ``ignore_index`` (as
  ``F.cross_entropy(reduction="mean")``: NaN when every row is ignored), ``count`` how many.
  The row sums run on the Tensor Engine (a matmul with a column of ones).
- ``cross_entropy_bwd(logits, target, lse, grad [1], count [1], ignore_index) -> dlogits``:
  ``(softmax(logits) - onehot(target)) * grad / count`` on the rows not ignored, 0 on the others.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ._tiles import P, column, hbm, load, psum, sbuf, spans

CHUNK = 4096  # columns of logits per tile


def _target_rows(target, r0, rows, ignore_index):
    """The tile's targets as float32 [rows, 1], and 1.0/0.0 for the rows not ignored."""
    view = target[r0:r0 + rows, 0:1] if len(target.shape) == 2 else target[r0:r0 + rows].reshape((rows, 1))
    t = load(view, nl.float32, name="target")
    valid = sbuf((rows, 1))
    nisa.tensor_scalar(dst=valid, data=t, op0=nl.not_equal, operand0=float(ignore_index))
    return t, valid


def _one_hot(t, c0, cols):
    """1.0 where the column ``c0 + j`` is the row's target."""
    rows = t.shape[0]
    hot = sbuf((rows, cols))
    nisa.iota(dst=hot, pattern=[[1, cols]], offset=c0)
    nisa.tensor_scalar(dst=hot, data=hot, op0=nl.equal, operand0=t)
    return hot


@nki.jit
def cross_entropy_fwd(logits, target, ignore_index):
    n, v = logits.shape
    loss = hbm((1,), nl.float32)
    lse = hbm((n,), nl.float32)
    count = hbm((1,), nl.float32)
    totals = sbuf((1, 2), name="totals")  # summed loss, rows counted
    nisa.memset(dst=totals, value=0.0)
    for r0, rows in spans(n, P):
        t, valid = _target_rows(target, r0, rows, ignore_index)
        m = column(rows, -1.0e30)
        s = column(rows, 0.0)
        picked = column(rows, 0.0)
        for c0, cols in spans(v, CHUNK):
            chunk = load(logits[r0:r0 + rows, c0:c0 + cols], name="logits")
            m_new = sbuf((rows, 1))
            nisa.tensor_reduce(dst=m_new, op=nl.maximum, data=chunk, axis=1)
            nisa.tensor_tensor(dst=m_new, data1=m_new, data2=m, op=nl.maximum)
            neg = sbuf((rows, 1))
            nisa.tensor_scalar(dst=neg, data=m_new, op0=nl.multiply, operand0=-1.0)
            e = sbuf((rows, cols))
            part = sbuf((rows, 1))
            nisa.activation_reduce(dst=e, op=nl.exp, data=chunk, bias=neg, reduce_op=nl.add, reduce_res=part)
            corr = sbuf((rows, 1))
            nisa.activation(dst=corr, op=nl.exp, data=m, bias=neg)
            nisa.scalar_tensor_tensor(dst=s, data=s, op0=nl.multiply, operand0=corr, op1=nl.add, operand1=part)
            m = m_new
            hot = _one_hot(t, c0, cols)
            nisa.tensor_tensor(dst=hot, data1=hot, data2=chunk, op=nl.multiply)
            nisa.tensor_reduce(dst=part, op=nl.add, data=hot, axis=1)
            nisa.tensor_tensor(dst=picked, data1=picked, data2=part, op=nl.add)
        row_lse = sbuf((rows, 1))
        nisa.activation(dst=row_lse, op=nl.log, data=s)
        nisa.tensor_tensor(dst=row_lse, data1=row_lse, data2=m, op=nl.add)
        nisa.dma_copy(dst=lse[r0:r0 + rows].reshape((rows, 1)), src=row_lse)
        both = sbuf((rows, 2))
        nisa.tensor_tensor(dst=both[:, 0:1], data1=row_lse, data2=picked, op=nl.subtract)
        nisa.tensor_tensor(dst=both[:, 0:1], data1=both[:, 0:1], data2=valid, op=nl.multiply)
        nisa.tensor_copy(dst=both[:, 1:2], src=valid)
        summed = psum((1, 2))
        nisa.nc_matmul(dst=summed, stationary=column(rows, 1.0), moving=both)
        nisa.tensor_tensor(dst=totals, data1=totals, data2=summed, op=nl.add)
    mean = sbuf((1, 1))
    nisa.tensor_scalar(dst=mean, data=totals[:, 0:1], op0=nl.divide, operand0=totals[:, 1:2])
    nisa.dma_copy(dst=loss.reshape((1, 1)), src=mean)
    nisa.dma_copy(dst=count.reshape((1, 1)), src=totals[:, 1:2])
    return loss, lse, count


@nki.jit
def cross_entropy_bwd(logits, target, lse, grad, count, ignore_index):
    n, v = logits.shape
    dlogits = hbm((n, v), logits.dtype)
    rows_max = min(n, P)
    scale = sbuf((rows_max, 1))  # grad / count, on every partition
    nisa.dma_copy(dst=scale, src=grad.reshape((1, 1)).broadcast(0, rows_max))
    counted = sbuf((rows_max, 1))
    nisa.dma_copy(dst=counted, src=count.reshape((1, 1)).broadcast(0, rows_max))
    nisa.tensor_tensor(dst=scale, data1=scale, data2=counted, op=nl.divide)
    for r0, rows in spans(n, P):
        t, valid = _target_rows(target, r0, rows, ignore_index)
        row_scale = sbuf((rows, 1))
        nisa.tensor_tensor(dst=row_scale, data1=valid, data2=scale[:rows], op=nl.multiply)
        neg = load(lse[r0:r0 + rows].reshape((rows, 1)))
        nisa.tensor_scalar(dst=neg, data=neg, op0=nl.multiply, operand0=-1.0)
        for c0, cols in spans(v, CHUNK):
            probs = sbuf((rows, cols))
            nisa.activation(dst=probs, op=nl.exp, data=load(logits[r0:r0 + rows, c0:c0 + cols]), bias=neg)
            nisa.tensor_tensor(dst=probs, data1=probs, data2=_one_hot(t, c0, cols), op=nl.subtract)
            out = sbuf((rows, cols), logits.dtype)
            nisa.tensor_scalar(dst=out, data=probs, op0=nl.multiply, operand0=row_scale)
            nisa.dma_copy(dst=dlogits[r0:r0 + rows, c0:c0 + cols], src=out)
    return dlogits
