"""Attention as NKI kernels: prefill (flash attention, forward and backward) and decode with a
KV cache.

- ``flash_fwd(q [B, H, S, Dh], k, v [B, Hkv, Sk, Dh], causal, scale) -> (o [B, H, S, Dh],
  lse [B, H, S] float32)``: per 128-row query tile, over 128-row key tiles (tiles wholly above
  the diagonal skipped when causal), an online softmax: running row max and sum, the output
  rescaled as the max grows. Grouped-query attention: head ``h`` reads key/value head
  ``h // (H // Hkv)``. Causal masking aligns the last query with the last key
  (``is_causal`` of ``scaled_dot_product_attention`` when S == Sk).
- ``flash_bwd(q, k, v, o, do, lse, causal, scale) -> (dq, dk, dv)``: FlashAttention-2's
  backward: probabilities recomputed from ``lse``, ``dS = P * (dP - rowsum(dO * O))``; key and
  value gradients summed over the heads sharing them.
- ``decode(q [B, H, Dh], k_new, v_new [B, Hkv, Dh], k_cache, v_cache [B, Hkv, Smax, Dh],
  position [B] int32) -> o [B, H, Dh]``: writes the new key and value into the caches at
  ``position[b]`` (in place, an indirect DMA whose offset is data), then attends each query over
  cache positions ``0..position[b]``; positions past it are masked (the kernel reads the whole
  cache: its loops cannot depend on data).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ._tiles import P, column, hbm, load, matmul_dtype, psum, sbuf, spans, transpose

NEG = -1.0e30  # a masked score: exp(NEG - max) is 0


def _mask_causal(scores, q0, k0, offset):
    """Keep ``scores[i, j]`` where key ``k0 + j`` <= query ``q0 + i + offset``; the rest NEG."""
    rows, cols = scores.shape
    nisa.affine_select(dst=scores, pattern=[[-1, cols]], channel_multiplier=1, on_true_tile=scores,
                       on_false_value=NEG, cmp_op=nl.greater_equal, offset=q0 + offset - k0)


def _visible(q0, rows, k0, causal, offset):
    """Does any key of the tile at ``k0`` precede a query of the tile at ``q0``?"""
    return not causal or k0 <= q0 + rows - 1 + offset


def _needs_mask(q0, k0, cols, causal, offset):
    return causal and k0 + cols - 1 > q0 + offset


@nki.jit
def flash_fwd(q, k, v, causal, scale):
    b, h, s, dh = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = h // hkv
    offset = sk - s
    mm = matmul_dtype(q.dtype)
    o = hbm((b, h, s, dh), q.dtype)
    lse = hbm((b, h, s), nl.float32)
    for bi in range(b):
        for hi in range(h):
            g = hi // group
            for q0, rows in spans(s, P):
                q_t = transpose(load(q[bi, hi, q0:q0 + rows, :], mm), mm)  # [Dh, rows]
                m = column(rows, NEG)
                l = column(rows, 0.0)
                acc = sbuf((rows, dh), name="acc")
                nisa.memset(dst=acc, value=0.0)
                for k0, cols in spans(sk, P):
                    if not _visible(q0, rows, k0, causal, offset):
                        continue
                    k_t = transpose(load(k[bi, g, k0:k0 + cols, :], mm), mm)  # [Dh, cols]
                    raw = psum((rows, cols))
                    nisa.nc_matmul(dst=raw, stationary=q_t, moving=k_t)
                    scores = sbuf((rows, cols))
                    nisa.tensor_scalar(dst=scores, data=raw, op0=nl.multiply, operand0=scale)
                    if _needs_mask(q0, k0, cols, causal, offset):
                        _mask_causal(scores, q0, k0, offset)
                    m_new = sbuf((rows, 1))
                    nisa.tensor_reduce(dst=m_new, op=nl.maximum, data=scores, axis=1)
                    nisa.tensor_tensor(dst=m_new, data1=m_new, data2=m, op=nl.maximum)
                    neg = sbuf((rows, 1))
                    nisa.tensor_scalar(dst=neg, data=m_new, op0=nl.multiply, operand0=-1.0)
                    probs = sbuf((rows, cols), mm)
                    rowsum = sbuf((rows, 1))
                    nisa.activation_reduce(dst=probs, op=nl.exp, data=scores, bias=neg, reduce_op=nl.add,
                                           reduce_res=rowsum)
                    corr = sbuf((rows, 1))
                    nisa.activation(dst=corr, op=nl.exp, data=m, bias=neg)  # exp(m - m_new)
                    nisa.scalar_tensor_tensor(dst=l, data=l, op0=nl.multiply, operand0=corr, op1=nl.add,
                                              operand1=rowsum)
                    pv = psum((rows, dh))
                    nisa.nc_matmul(dst=pv, stationary=transpose(probs, mm), moving=load(v[bi, g, k0:k0 + cols, :], mm))
                    nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=corr, op1=nl.add,
                                              operand1=pv)
                    m = m_new
                out = sbuf((rows, dh), q.dtype)
                nisa.tensor_scalar(dst=out, data=acc, op0=nl.divide, operand0=l)
                nisa.dma_copy(dst=o[bi, hi, q0:q0 + rows, :], src=out)
                logsum = sbuf((rows, 1))
                nisa.activation(dst=logsum, op=nl.log, data=l)
                nisa.tensor_tensor(dst=logsum, data1=logsum, data2=m, op=nl.add)
                nisa.dma_copy(dst=lse[bi, hi, q0:q0 + rows].reshape((rows, 1)), src=logsum)
    return o, lse


@nki.jit
def flash_bwd(q, k, v, o, do, lse, causal, scale):
    b, h, s, dh = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = h // hkv
    offset = sk - s
    mm = matmul_dtype(q.dtype)
    dq = hbm((b, h, s, dh), q.dtype)
    dk = hbm((b, hkv, sk, dh), k.dtype)
    dv = hbm((b, hkv, sk, dh), v.dtype)
    q_tiles, k_tiles = spans(s, P), spans(sk, P)
    for bi in range(b):
        for g in range(hkv):
            dk_acc = [sbuf((cols, dh), name="dk") for _, cols in k_tiles]
            dv_acc = [sbuf((cols, dh), name="dv") for _, cols in k_tiles]
            for t in dk_acc + dv_acc:
                nisa.memset(dst=t, value=0.0)
            for hi in range(g * group, (g + 1) * group):
                for q0, rows in q_tiles:
                    q_row = load(q[bi, hi, q0:q0 + rows, :], mm)
                    q_t = transpose(q_row, mm)
                    do_row = load(do[bi, hi, q0:q0 + rows, :], mm)
                    do_t = transpose(do_row, mm)
                    # rowsum(dO * O) and -lse, per query row
                    prod = sbuf((rows, dh))
                    nisa.tensor_tensor(dst=prod, data1=load(do[bi, hi, q0:q0 + rows, :]),
                                       data2=load(o[bi, hi, q0:q0 + rows, :]), op=nl.multiply)
                    delta = sbuf((rows, 1))
                    nisa.tensor_reduce(dst=delta, op=nl.add, data=prod, axis=1)
                    neg_lse = load(lse[bi, hi, q0:q0 + rows].reshape((rows, 1)))
                    nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0)
                    dq_acc = sbuf((rows, dh), name="dq")
                    nisa.memset(dst=dq_acc, value=0.0)
                    for j, (k0, cols) in enumerate(k_tiles):
                        if not _visible(q0, rows, k0, causal, offset):
                            continue
                        k_row = load(k[bi, g, k0:k0 + cols, :], mm)
                        raw = psum((rows, cols))
                        nisa.nc_matmul(dst=raw, stationary=q_t, moving=transpose(k_row, mm))
                        scores = sbuf((rows, cols))
                        nisa.tensor_scalar(dst=scores, data=raw, op0=nl.multiply, operand0=scale)
                        if _needs_mask(q0, k0, cols, causal, offset):
                            _mask_causal(scores, q0, k0, offset)
                        probs = sbuf((rows, cols))
                        nisa.activation(dst=probs, op=nl.exp, data=scores, bias=neg_lse)
                        probs_mm = sbuf((rows, cols), mm)
                        nisa.tensor_copy(dst=probs_mm, src=probs)
                        # dV += P.T @ dO
                        part = psum((cols, dh))
                        nisa.nc_matmul(dst=part, stationary=probs_mm, moving=do_row)
                        nisa.tensor_tensor(dst=dv_acc[j], data1=dv_acc[j], data2=part, op=nl.add)
                        # dP = dO @ V.T ; dS = P * (dP - delta) * scale
                        dp = psum((rows, cols))
                        nisa.nc_matmul(dst=dp, stationary=do_t, moving=transpose(load(v[bi, g, k0:k0 + cols, :], mm), mm))
                        ds = sbuf((rows, cols))
                        nisa.tensor_scalar(dst=ds, data=dp, op0=nl.subtract, operand0=delta, op1=nl.multiply,
                                           operand1=scale)
                        ds_mm = sbuf((rows, cols), mm)
                        nisa.tensor_tensor(dst=ds_mm, data1=ds, data2=probs, op=nl.multiply)
                        # dQ += dS @ K ; dK += dS.T @ Q
                        part = psum((rows, dh))
                        nisa.nc_matmul(dst=part, stationary=transpose(ds_mm, mm), moving=k_row)
                        nisa.tensor_tensor(dst=dq_acc, data1=dq_acc, data2=part, op=nl.add)
                        part = psum((cols, dh))
                        nisa.nc_matmul(dst=part, stationary=ds_mm, moving=q_row)
                        nisa.tensor_tensor(dst=dk_acc[j], data1=dk_acc[j], data2=part, op=nl.add)
                    out = sbuf((rows, dh), q.dtype)
                    nisa.tensor_copy(dst=out, src=dq_acc)
                    nisa.dma_copy(dst=dq[bi, hi, q0:q0 + rows, :], src=out)
            for j, (k0, cols) in enumerate(k_tiles):
                nisa.dma_copy(dst=dk[bi, g, k0:k0 + cols, :], src=dk_acc[j])
                nisa.dma_copy(dst=dv[bi, g, k0:k0 + cols, :], src=dv_acc[j])
    return dq, dk, dv


@nki.jit
def decode(q, k_new, v_new, k_cache, v_cache, position, scale):
    b, h, dh = q.shape
    hkv, smax = k_cache.shape[1], k_cache.shape[2]
    group = h // hkv
    mm = matmul_dtype(q.dtype)
    o = hbm((b, h, dh), q.dtype)
    for bi in range(b):
        pos = load(position[bi:bi + 1].reshape((1, 1)), nl.int32, name="position")
        # the new token's key and value into the caches, at position[b]
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            row = load(new[bi, :, :].reshape((hkv, 1, dh)), cache.dtype)
            target = cache[bi].ap(pattern=[[smax * dh, hkv], [dh, 1], [1, dh]], scalar_offset=pos, indirect_dim=1)
            nisa.dma_copy(dst=target, src=row)
        # positions past position[b], per query row: masked
        pos_rows = sbuf((group, 1))
        nisa.dma_copy(dst=pos_rows, src=position[bi:bi + 1].reshape((1, 1)).broadcast(0, group))
        for g in range(hkv):
            q_t = transpose(load(q[bi, g * group:(g + 1) * group, :], mm), mm)  # [Dh, group]
            scores = sbuf((group, smax))
            for k0, cols in spans(smax, P):
                raw = psum((group, cols))
                nisa.nc_matmul(dst=raw, stationary=q_t, moving=transpose(load(k_cache[bi, g, k0:k0 + cols, :], mm), mm))
                index = sbuf((group, cols))
                nisa.iota(dst=index, pattern=[[1, cols]], offset=k0)
                past = sbuf((group, cols))
                nisa.tensor_scalar(dst=past, data=index, op0=nl.greater, operand0=pos_rows, op1=nl.multiply,
                                   operand1=NEG)
                nisa.scalar_tensor_tensor(dst=scores[:, k0:k0 + cols], data=raw, op0=nl.multiply, operand0=scale,
                                          op1=nl.add, operand1=past)
            top = sbuf((group, 1))
            nisa.tensor_reduce(dst=top, op=nl.maximum, data=scores, axis=1)
            nisa.tensor_scalar(dst=top, data=top, op0=nl.multiply, operand0=-1.0)
            probs = sbuf((group, smax), mm)
            total = sbuf((group, 1))
            nisa.activation_reduce(dst=probs, op=nl.exp, data=scores, bias=top, reduce_op=nl.add, reduce_res=total)
            acc = psum((group, dh))
            for index, (k0, cols) in enumerate(spans(smax, P)):
                nisa.nc_matmul(dst=acc, stationary=transpose(probs[:, k0:k0 + cols], mm),
                               moving=load(v_cache[bi, g, k0:k0 + cols, :], mm), accumulate=index > 0)
            out = sbuf((group, dh), q.dtype)
            nisa.tensor_scalar(dst=out, data=acc, op0=nl.divide, operand0=total)
            nisa.dma_copy(dst=o[bi, g * group:(g + 1) * group, :], src=out)
    return o
