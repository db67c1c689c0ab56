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


@nki.jit
def gated_mlp_bwd(gy, x, w_gate, w_up, w_down, act):
    n, d = x.shape
    f = w_gate.shape[0]
    mm = matmul_dtype(x.dtype)
    dx = hbm((n, d), x.dtype)
    dw_gate = hbm((f, d), w_gate.dtype)
    dw_up = hbm((f, d), w_up.dtype)
    dw_down = hbm((d, f), w_down.dtype)
    acc_gate = [sbuf((fc, d), name="dw_gate") for _, fc in spans(f, P)]
    acc_up = [sbuf((fc, d), name="dw_up") for _, fc in spans(f, P)]
    acc_down = [sbuf((dc, f), name="dw_down") for _, dc in spans(d, P)]
    for t in acc_gate + acc_up + acc_down:
        nisa.memset(dst=t, value=0.0)
    for r0, rows in spans(n, P):
        x_row = load(x[r0:r0 + rows, :], mm)
        x_t = transposed_chunks(x_row, mm)
        hidden, gate, up = _hidden(x_t, w_gate, w_up, f, act, mm, keep_parts=True)
        gy_row = load(gy[r0:r0 + rows, :], mm)
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
        # dx = d_gate @ w_gate + d_up @ w_up
        dg_t, du_t = transposed_chunks(d_gate, mm), transposed_chunks(d_up, mm)
        out = sbuf((rows, d), x.dtype)
        for d0, dc in spans(d, FMAX):
            part = matmul_rows(dg_t, w_gate, d0, dc, psum((rows, dc)))
            matmul_rows(du_t, w_up, d0, dc, part, first=False)
            nisa.tensor_copy(dst=out[:, d0:d0 + dc], src=part)
        nisa.dma_copy(dst=dx[r0:r0 + rows, :], src=out)
        # weight gradients: contractions over this tile's rows
        for i, (f0, fc) in enumerate(spans(f, P)):
            row_sums_into(acc_gate[i], d_gate[:, f0:f0 + fc], x_row)
            row_sums_into(acc_up[i], d_up[:, f0:f0 + fc], x_row)
        for i, (d0, dc) in enumerate(spans(d, P)):
            row_sums_into(acc_down[i], gy_row[:, d0:d0 + dc], hidden)
    for i, (f0, fc) in enumerate(spans(f, P)):
        nisa.dma_copy(dst=dw_gate[f0:f0 + fc, :], src=acc_gate[i])
        nisa.dma_copy(dst=dw_up[f0:f0 + fc, :], src=acc_up[i])
    for i, (d0, dc) in enumerate(spans(d, P)):
        nisa.dma_copy(dst=dw_down[d0:d0 + dc, :], src=acc_down[i])
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


@nki.jit
def moe_fwd(x, router, w_gate, w_up, w_down, k, renormalize, act):
    n, d = x.shape
    e, f = w_gate.shape[0], w_gate.shape[1]
    mm = matmul_dtype(x.dtype)
    y = hbm((n, d), x.dtype)
    for r0, rows in spans(n, P):
        x_t = transposed_chunks(load(x[r0:r0 + rows, :], mm), mm)
        logits = sbuf((rows, e))
        nisa.tensor_copy(dst=logits, src=linear_t(x_t, router, 0, e, psum((rows, e))))
        weights, index = _top_k(logits, k, renormalize)
        # combine[r, j] = the routing weight of expert j for row r (0 if not picked)
        expert = sbuf((rows, e))
        nisa.iota(dst=expert, pattern=[[1, e]])
        picked = sbuf((rows, 8))
        nisa.tensor_copy(dst=picked, src=index)
        combine = sbuf((rows, e))
        nisa.memset(dst=combine, value=0.0)
        hit = sbuf((rows, e))
        for j in range(k):
            nisa.tensor_scalar(dst=hit, data=expert, op0=nl.equal, operand0=picked[:, j:j + 1], op1=nl.multiply,
                               operand1=weights[:, j:j + 1])
            nisa.tensor_tensor(dst=combine, data1=combine, data2=hit, op=nl.add)
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
