"""The gated MLP and mixture-of-experts as NKI kernels.

Weights are in ``nn.Linear`` layout ([out, in]): the kernels take a model's parameters as they
are, and transpose weight blocks on their way into SBUF (DMA transposes).

- ``gated_mlp_fwd(x [N, D], w_gate, w_up [F, D], w_down [D, F], act) -> y [N, D]``:
  ``y = (act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T`` (SwiGLU with ``act = "silu"``, GeGLU with
  ``"gelu"``); per 128-row tile, the hidden activations stay in SBUF.
- ``gated_mlp_bwd(gy, x, w_gate, w_up, w_down, act) -> (dx, dw_gate, dw_up, dw_down)``: the
  hidden activations recomputed; weight gradients accumulated in SBUF over the row tiles (so
  ``F * D`` is bounded by SBUF: the trial refuses sizes that do not fit).
- ``router_top_k(logits [N, E], k, renormalize) -> (weights [N, k] float32, indices [N, k] int32)``:
  the ``k`` largest logits of each row (Vector Engine ``max8``/``nc_find_index8``, descending)
  and their softmax weights: over the ``k`` (``renormalize``, Mixtral's) or over all ``E``.
- ``moe_fwd(x [N, D], router [E, D], w_gate, w_up [E, F, D], w_down [E, D, F], k, renormalize,
  act) -> y [N, D]``: the router and top-k, then every expert's gated MLP on the row tile,
  weighted by the token's routing weight for it (0 for the experts it did not pick). Dense:
  the Tensor Engine runs every expert for every token (``E / k`` times the work of a kernel
  that gathers each expert's tokens, which needs loops whose bounds are data).
- ``moe_bwd(gy, x, router, w_gate, w_up, w_down, k, renormalize, act) -> (dx, d_router,
  dw_gate, dw_up, dw_down)``: every expert's backward (dense too), and the routing weights'
  gradient through the top-k softmax to the router and to x. The experts' weight gradients are
  accumulated in SBUF (``E * F * D`` bounded by it).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ._tiles import FMAX, P, hbm, linear_t, load, matmul_dtype, matmul_rows, psum, row_sums_into, sbuf, spans, \
    transposed_chunks

_ACT = {"silu": (nl.silu, nl.silu_dx), "gelu": (nl.gelu, nl.gelu_dx)}
NEG = -1.0e30


def _hidden(x_t, w_gate, w_up, f, act, mm, keep_parts=False):
    """``act(x @ w_gate.T) * (x @ w_up.T)`` for one row tile (``x_t``: x's transposed chunks):
    the hidden tile [rows, F] in the matmul dtype, and with ``keep_parts`` the pre-activations
    (gate, up) in float32."""
    rows = x_t[0][2].shape[1]
    hidden = sbuf((rows, f), mm, name="hidden")
    gate_all = sbuf((rows, f), name="gate") if keep_parts else None
    up_all = sbuf((rows, f), name="up") if keep_parts else None
    for f0, fc in spans(f, FMAX):
        gate = linear_t(x_t, w_gate, f0, fc, psum((rows, fc)))
        up = linear_t(x_t, w_up, f0, fc, psum((rows, fc)))
        activated = sbuf((rows, fc))
        nisa.activation(dst=activated, op=_ACT[act][0], data=gate)
        nisa.tensor_tensor(dst=hidden[:, f0:f0 + fc], data1=activated, data2=up, op=nl.multiply)
        if keep_parts:
            nisa.tensor_copy(dst=gate_all[:, f0:f0 + fc], src=gate)
            nisa.tensor_copy(dst=up_all[:, f0:f0 + fc], src=up)
    return hidden, gate_all, up_all


@nki.jit
def gated_mlp_fwd(x, w_gate, w_up, w_down, act):
    n, d = x.shape
    f = w_gate.shape[0]
    mm = matmul_dtype(x.dtype)
    y = hbm((n, d), x.dtype)
    for r0, rows in spans(n, P):
        x_t = transposed_chunks(load(x[r0:r0 + rows, :], mm), mm)
        hidden, _, _ = _hidden(x_t, w_gate, w_up, f, act, mm)
        h_t = transposed_chunks(hidden, mm)
        out = sbuf((rows, d), x.dtype)
        for d0, dc in spans(d, FMAX):
            part = linear_t(h_t, w_down, d0, dc, psum((rows, dc)))
            nisa.tensor_copy(dst=out[:, d0:d0 + dc], src=part)
        nisa.dma_copy(dst=y[r0:r0 + rows, :], src=out)
    return y


def _mlp_backward_tile(x_row, x_t, gy_row, w_gate, w_up, w_down, act, mm, acc_gate, acc_up, acc_down, dx_acc):
    """The gated MLP's backward for one row tile: ``dx_acc`` [rows, D] float32 += dx, and the
    weight gradients' accumulators (per 128-row block) += this tile's contributions. ``gy_row``:
    the output gradient [rows, D] in the matmul dtype. Returns the tile's output ``y``'s
    hidden activations (the matmul dtype)."""
    rows, d = x_row.shape
    f = w_gate.shape[0]
    hidden, gate, up = _hidden(x_t, w_gate, w_up, f, act, mm, keep_parts=True)
    gy_t = transposed_chunks(gy_row, mm)
    d_gate = sbuf((rows, f), mm, name="d_gate")
    d_up = sbuf((rows, f), mm, name="d_up")
    for f0, fc in spans(f, FMAX):
        d_hidden = matmul_rows(gy_t, w_down, f0, fc, psum((rows, fc)))  # gy @ w_down
        g, u = gate[:, f0:f0 + fc], up[:, f0:f0 + fc]
        t = sbuf((rows, fc))
        nisa.activation(dst=t, op=_ACT[act][0], data=g)  # act(g)
        nisa.tensor_tensor(dst=d_up[:, f0:f0 + fc], data1=d_hidden, data2=t, op=nl.multiply)
        nisa.activation(dst=t, op=_ACT[act][1], data=g)  # act'(g)
        nisa.tensor_tensor(dst=t, data1=t, data2=u, op=nl.multiply)
        nisa.tensor_tensor(dst=d_gate[:, f0:f0 + fc], data1=t, data2=d_hidden, op=nl.multiply)
    # dx += d_gate @ w_gate + d_up @ w_up
    dg_t, du_t = transposed_chunks(d_gate, mm), transposed_chunks(d_up, mm)
    for d0, dc in spans(d, FMAX):
        part = matmul_rows(dg_t, w_gate, d0, dc, psum((rows, dc)))
        matmul_rows(du_t, w_up, d0, dc, part, first=False)
        nisa.tensor_tensor(dst=dx_acc[:, d0:d0 + dc], data1=dx_acc[:, d0:d0 + dc], data2=part, op=nl.add)
    # weight gradients: contractions over this tile's rows
    for i, (f0, fc) in enumerate(spans(f, P)):
        row_sums_into(acc_gate[i], d_gate[:, f0:f0 + fc], x_row)
        row_sums_into(acc_up[i], d_up[:, f0:f0 + fc], x_row)
    for i, (d0, dc) in enumerate(spans(d, P)):
        row_sums_into(acc_down[i], gy_row[:, d0:d0 + dc], hidden)
    return hidden


def _weight_accumulators(d, f):
    acc_gate = [sbuf((fc, d), name="dw_gate") for _, fc in spans(f, P)]
    acc_up = [sbuf((fc, d), name="dw_up") for _, fc in spans(f, P)]
    acc_down = [sbuf((dc, f), name="dw_down") for _, dc in spans(d, P)]
    for t in acc_gate + acc_up + acc_down:
        nisa.memset(dst=t, value=0.0)
    return acc_gate, acc_up, acc_down


def _store_weight_grads(acc_gate, acc_up, acc_down, dw_gate, dw_up, dw_down):
    for i, (f0, fc) in enumerate(spans(dw_gate.shape[0], P)):
        nisa.dma_copy(dst=dw_gate[f0:f0 + fc, :], src=acc_gate[i])
        nisa.dma_copy(dst=dw_up[f0:f0 + fc, :], src=acc_up[i])
    for i, (d0, dc) in enumerate(spans(dw_down.shape[0], P)):
        nisa.dma_copy(dst=dw_down[d0:d0 + dc, :], src=acc_down[i])


@nki.jit
def gated_mlp_bwd(gy, x, w_gate, w_up, w_down, act):
    n, d = x.shape
    f = w_gate.shape[0]
    mm = matmul_dtype(x.dtype)
    dx = hbm((n, d), x.dtype)
    dw_gate = hbm((f, d), w_gate.dtype)
    dw_up = hbm((f, d), w_up.dtype)
    dw_down = hbm((d, f), w_down.dtype)
    accumulators = _weight_accumulators(d, f)
    for r0, rows in spans(n, P):
        x_row = load(x[r0:r0 + rows, :], mm)
        dx_acc = sbuf((rows, d), name="dx")
        nisa.memset(dst=dx_acc, value=0.0)
        _mlp_backward_tile(x_row, transposed_chunks(x_row, mm), load(gy[r0:r0 + rows, :], mm), w_gate, w_up, w_down,
                           act, mm, *accumulators, dx_acc)
        nisa.dma_copy(dst=dx[r0:r0 + rows, :], src=dx_acc)
    _store_weight_grads(*accumulators, dw_gate, dw_up, dw_down)
    return dx, dw_gate, dw_up, dw_down


def _top_k(logits, k, renormalize):
    """The top-k of a [rows, E] float32 tile: (weights [rows, k] float32, indices [rows, 8] uint32)."""
    rows, e = logits.shape
    padded = logits
    if e < 8:  # max8 reads at least 8 values: pad with -inf
        padded = sbuf((rows, 8))
        nisa.memset(dst=padded, value=NEG)
        nisa.tensor_copy(dst=padded[:, 0:e], src=logits)
    top = sbuf((rows, 8))
    nisa.max8(dst=top, src=padded)
    index = sbuf((rows, 8), nl.uint32)
    nisa.nc_find_index8(dst=index, data=padded, vals=top)
    neg = sbuf((rows, 1))
    nisa.tensor_scalar(dst=neg, data=top[:, 0:1], op0=nl.multiply, operand0=-1.0)
    weights = sbuf((rows, k))
    total = sbuf((rows, 1))
    nisa.activation_reduce(dst=weights, op=nl.exp, data=top[:, 0:k], bias=neg, reduce_op=nl.add, reduce_res=total)
    if not renormalize:  # softmax over all E: the denominator sums every logit
        every = sbuf((rows, e))
        nisa.activation_reduce(dst=every, op=nl.exp, data=logits, bias=neg, reduce_op=nl.add, reduce_res=total)
    nisa.tensor_scalar(dst=weights, data=weights, op0=nl.divide, operand0=total)
    return weights, index


@nki.jit
def router_top_k(logits, k, renormalize):
    n, e = logits.shape
    weights = hbm((n, k), nl.float32)
    indices = hbm((n, k), nl.int32)
    for r0, rows in spans(n, P):
        w, index = _top_k(load(logits[r0:r0 + rows, :]), k, renormalize)
        nisa.dma_copy(dst=weights[r0:r0 + rows, :], src=w)
        nisa.dma_copy(dst=indices[r0:r0 + rows, :], src=index[:, 0:k])
    return weights, indices


def _routing(x_t, router, k, renormalize):
    """A row tile's routing: ``combine`` [rows, E] (expert j's routing weight, 0 if not picked),
    ``picked`` [rows, E] (1.0 for the k experts picked) and ``probs`` [rows, E], the softmax
    the weights come from (over the k: ``combine`` itself; over all E otherwise)."""
    rows, e = x_t[0][2].shape[1], router.shape[0]
    logits = sbuf((rows, e))
    nisa.tensor_copy(dst=logits, src=linear_t(x_t, router, 0, e, psum((rows, e))))
    weights, index = _top_k(logits, k, renormalize)
    expert = sbuf((rows, e))
    nisa.iota(dst=expert, pattern=[[1, e]])
    chosen = sbuf((rows, 8))
    nisa.tensor_copy(dst=chosen, src=index)
    combine, picked, hit = sbuf((rows, e)), sbuf((rows, e)), sbuf((rows, e))
    nisa.memset(dst=combine, value=0.0)
    nisa.memset(dst=picked, value=0.0)
    for j in range(k):
        nisa.tensor_scalar(dst=hit, data=expert, op0=nl.equal, operand0=chosen[:, j:j + 1])
        nisa.tensor_tensor(dst=picked, data1=picked, data2=hit, op=nl.add)
        nisa.tensor_scalar(dst=hit, data=hit, op0=nl.multiply, operand0=weights[:, j:j + 1])
        nisa.tensor_tensor(dst=combine, data1=combine, data2=hit, op=nl.add)
    probs = combine
    if not renormalize:
        top = sbuf((rows, 1))
        nisa.tensor_reduce(dst=top, op=nl.maximum, data=logits, axis=1)
        nisa.tensor_scalar(dst=top, data=top, op0=nl.multiply, operand0=-1.0)
        probs, total = sbuf((rows, e)), sbuf((rows, 1))
        nisa.activation_reduce(dst=probs, op=nl.exp, data=logits, bias=top, reduce_op=nl.add, reduce_res=total)
        nisa.tensor_scalar(dst=probs, data=probs, op0=nl.divide, operand0=total)
    return combine, picked, probs


@nki.jit
def moe_fwd(x, router, w_gate, w_up, w_down, k, renormalize, act):
    n, d = x.shape
    e, f = w_gate.shape[0], w_gate.shape[1]
    mm = matmul_dtype(x.dtype)
    y = hbm((n, d), x.dtype)
    for r0, rows in spans(n, P):
        x_t = transposed_chunks(load(x[r0:r0 + rows, :], mm), mm)
        combine, _, _ = _routing(x_t, router, k, renormalize)
        acc = sbuf((rows, d), name="acc")
        nisa.memset(dst=acc, value=0.0)
        for ei in range(e):
            hidden, _, _ = _hidden(x_t, w_gate[ei], w_up[ei], f, act, mm)
            h_t = transposed_chunks(hidden, mm)
            for d0, dc in spans(d, FMAX):
                part = linear_t(h_t, w_down[ei], d0, dc, psum((rows, dc)))
                nisa.scalar_tensor_tensor(dst=acc[:, d0:d0 + dc], data=part, op0=nl.multiply,
                                          operand0=combine[:, ei:ei + 1], op1=nl.add, operand1=acc[:, d0:d0 + dc])
        out = sbuf((rows, d), x.dtype)
        nisa.tensor_copy(dst=out, src=acc)
        nisa.dma_copy(dst=y[r0:r0 + rows, :], src=out)
    return y


@nki.jit
def moe_bwd(gy, x, router, w_gate, w_up, w_down, k, renormalize, act):
    """The MoE layer's backward: each expert's gated-MLP backward on the output gradient scaled
    by its routing weight; the routing weights' gradient ``dc[:, j] = rowsum(gy * y_j)`` (each
    expert's output recomputed) through the softmax of the top-k (``dlogit = q * (m*dc -
    rowsum(q*m*dc))``, ``m`` the picked experts, ``q`` the softmax) to the router and to x."""
    n, d = x.shape
    e, f = w_gate.shape[0], w_gate.shape[1]
    mm = matmul_dtype(x.dtype)
    dx = hbm((n, d), x.dtype)
    d_router = hbm((e, d), router.dtype)
    dw_gate, dw_up = hbm((e, f, d), w_gate.dtype), hbm((e, f, d), w_up.dtype)
    dw_down = hbm((e, d, f), w_down.dtype)
    accumulators = [_weight_accumulators(d, f) for _ in range(e)]
    acc_router = sbuf((e, d), name="d_router")
    nisa.memset(dst=acc_router, value=0.0)
    for r0, rows in spans(n, P):
        x_row = load(x[r0:r0 + rows, :], mm)
        x_t = transposed_chunks(x_row, mm)
        combine, picked, probs = _routing(x_t, router, k, renormalize)
        gy_row = load(gy[r0:r0 + rows, :], name="gy")
        dx_acc = sbuf((rows, d), name="dx")
        nisa.memset(dst=dx_acc, value=0.0)
        d_combine = sbuf((rows, e))
        for ei in range(e):
            scaled = sbuf((rows, d), mm)
            nisa.tensor_scalar(dst=scaled, data=gy_row, op0=nl.multiply, operand0=combine[:, ei:ei + 1])
            hidden = _mlp_backward_tile(x_row, x_t, scaled, w_gate[ei], w_up[ei], w_down[ei], act, mm,
                                        *accumulators[ei], dx_acc)
            h_t = transposed_chunks(hidden, mm)
            total = sbuf((rows, 1))
            nisa.memset(dst=total, value=0.0)
            for d0, dc in spans(d, FMAX):  # rowsum(gy * y_e)
                part = linear_t(h_t, w_down[ei], d0, dc, psum((rows, dc)))
                prod, partial = sbuf((rows, dc)), sbuf((rows, 1))
                nisa.tensor_tensor(dst=prod, data1=part, data2=gy_row[:, d0:d0 + dc], op=nl.multiply)
                nisa.tensor_reduce(dst=partial, op=nl.add, data=prod, axis=1)
                nisa.tensor_tensor(dst=total, data1=total, data2=partial, op=nl.add)
            nisa.tensor_copy(dst=d_combine[:, ei:ei + 1], src=total)
        # through the top-k softmax to the logits
        masked, prod, dot = sbuf((rows, e)), sbuf((rows, e)), sbuf((rows, 1))
        nisa.tensor_tensor(dst=masked, data1=d_combine, data2=picked, op=nl.multiply)
        nisa.tensor_tensor(dst=prod, data1=masked, data2=probs, op=nl.multiply)
        nisa.tensor_reduce(dst=dot, op=nl.add, data=prod, axis=1)
        d_logits = sbuf((rows, e), mm)
        nisa.tensor_scalar(dst=masked, data=masked, op0=nl.subtract, operand0=dot)
        nisa.tensor_tensor(dst=d_logits, data1=masked, data2=probs, op=nl.multiply)
        # dx += d_logits @ router ; d_router += d_logits.T @ x
        dl_t = transposed_chunks(d_logits, mm)
        for d0, dc in spans(d, FMAX):
            part = matmul_rows(dl_t, router, d0, dc, psum((rows, dc)))
            nisa.tensor_tensor(dst=dx_acc[:, d0:d0 + dc], data1=dx_acc[:, d0:d0 + dc], data2=part, op=nl.add)
        row_sums_into(acc_router, d_logits, x_row)
        nisa.dma_copy(dst=dx[r0:r0 + rows, :], src=dx_acc)
    for ei in range(e):
        _store_weight_grads(*accumulators[ei], dw_gate[ei], dw_up[ei], dw_down[ei])
    nisa.dma_copy(dst=d_router, src=acc_router)
    return dx, d_router, dw_gate, dw_up, dw_down
