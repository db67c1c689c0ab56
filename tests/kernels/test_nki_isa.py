"""The simulated NKI's instructions and views, each against numpy (device/nki)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def sbuf_in(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    return t


def hbm_out(t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def on_chip(body, *arrays, shape=None, dtype=np.float32):
    """Run ``body(dst, *sbuf_tiles)`` in a kernel; return dst."""

    @nki.jit
    def kernel(*ins):
        tiles = [sbuf_in(x) for x in ins]
        dst = nl.ndarray(shape or ins[0].shape, dtype, buffer=nl.sbuf)
        body(dst, *tiles)
        return hbm_out(dst)

    return nki.simulate(kernel)(*arrays)


# -- data movement -----------------------------------------------------------------------------------------


def test_dma_copy_casts_through_float32_and_copies_strided_views():
    x = rand(64, 96)

    @nki.jit
    def kernel(a):
        t = nl.ndarray((64, 48), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[:, ::2])
        return hbm_out(t)

    out = nki.simulate(kernel)(x)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, x[:, ::2].astype(ml_dtypes.bfloat16))


def test_dma_copy_gathers_rows_with_a_vector_offset():
    data, idx = rand(200, 16), np.array([[5], [199], [0], [7]], dtype=np.uint32)

    @nki.jit
    def kernel(d, i):
        ix = sbuf_in(i)
        t = nl.ndarray((4, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=d.ap(pattern=[[16, 4], [1, 16]], vector_offset=ix, indirect_dim=0))
        return hbm_out(t)

    np.testing.assert_array_equal(nki.simulate(kernel)(data, idx), data[idx[:, 0]])


def test_memset_and_fresh_tensors_hold_the_sentinel():
    @nki.jit
    def kernel():
        a = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((8, 4), nl.int32, buffer=nl.sbuf)
        c = nl.ndarray((8, 4), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=c, value=2.5)
        return hbm_out(a), hbm_out(b), hbm_out(c)

    a, b, c = nki.simulate(kernel)()
    assert np.isnan(a).all() and (b == 4).all()  # nki_simulator.rst: NaN for floats, 4 for integers
    assert (c.astype(np.float32) == 2.5).all()


def test_tensor_copy_casts_and_reads_psum():
    x = rand(32, 64)

    def body(dst, t):
        p = nl.ndarray(t.shape, nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=t)
        nisa.tensor_copy(dst=dst, src=p, engine=nisa.scalar_engine)

    out = on_chip(body, x, dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16))


# -- element-wise ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op, ref", [(nl.add, np.add), (nl.subtract, np.subtract), (nl.multiply, np.multiply),
                                     (nl.maximum, np.maximum), (nl.minimum, np.minimum),
                                     (nl.greater_equal, lambda a, b: (a >= b).astype(np.float32))])
def test_tensor_tensor(op, ref):
    a, b = rand(128, 40), rand(128, 40)
    out = on_chip(lambda dst, x, y: nisa.tensor_tensor(dst=dst, data1=x, data2=y, op=op), a, b)
    np.testing.assert_array_equal(out, ref(a, b))


def test_tensor_tensor_bitvec_on_integers_and_power():
    a = RNG.integers(0, 1 << 20, (16, 8)).astype(np.int32)
    b = RNG.integers(0, 1 << 20, (16, 8)).astype(np.int32)
    out = on_chip(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.bitwise_and), a, b, dtype=np.int32)
    np.testing.assert_array_equal(out, a & b)
    x, y = np.abs(rand(16, 8)) + 0.5, rand(16, 8)
    out = on_chip(lambda d, p, q: nisa.tensor_tensor(d, p, q, nl.power), x, y)
    np.testing.assert_allclose(out, np.power(x, y), rtol=1e-6)


def test_tensor_tensor_rounds_bf16_once_from_float32():
    a, b = rand(8, 8, dtype=ml_dtypes.bfloat16), rand(8, 8, dtype=ml_dtypes.bfloat16)
    out = on_chip(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.multiply), a, b, dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out, (a.astype(np.float32) * b.astype(np.float32)).astype(ml_dtypes.bfloat16))


def test_tensor_scalar_with_scalars_vectors_and_reverse():
    x, v = rand(64, 32), rand(64, 1)

    def body(dst, t, vec):
        nisa.tensor_scalar(dst=dst, data=t, op0=nl.subtract, operand0=vec, reverse0=True, op1=nl.multiply,
                           operand1=3.0)

    np.testing.assert_allclose(on_chip(body, x, v), (v - x) * 3.0, rtol=1e-6)
    out = on_chip(lambda d, t: nisa.tensor_scalar(d, t, nl.rsqrt, None), np.abs(x) + 1)
    np.testing.assert_allclose(out, 1 / np.sqrt(np.abs(x) + 1), rtol=1e-6)


def test_scalar_tensor_tensor():
    x, y = rand(16, 24), rand(16, 24)
    out = on_chip(lambda d, a, b: nisa.scalar_tensor_tensor(dst=d, data=a, op0=nl.multiply, operand0=2.0,
                                                            op1=nl.add, operand1=b), x, y)
    np.testing.assert_allclose(out, x * 2 + y, rtol=1e-6)


def test_tensor_tensor_scan_is_a_per_partition_recurrence():
    a, b = rand(8, 50), rand(8, 50)
    out = on_chip(lambda d, x, y: nisa.tensor_tensor_scan(dst=d, data0=x, data1=y, initial=0.5, op0=nl.multiply,
                                                          op1=nl.add), a, b)
    ref = np.empty_like(a)
    prev = np.full(8, 0.5, np.float32)
    for i in range(50):
        prev = a[:, i] * prev + b[:, i]
        ref[:, i] = prev
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_activation_scale_bias_and_accumulated_reduction():
    x, bias = rand(32, 64), rand(32, 1)

    @nki.jit
    def kernel(a, b):
        t, bt = sbuf_in(a), sbuf_in(b)
        e = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        acc = nl.ndarray((32, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=t, scale=0.5, bias=bt, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=e, op=nl.exp, data=t, scale=0.5, bias=bt, reduce_op=nl.add, reduce_res=acc,
                        reduce_cmd=nisa.reduce_cmd.reduce)  # the registers keep accumulating
        return hbm_out(e), hbm_out(acc)

    e, acc = nki.simulate(kernel)(x, bias)
    ref = np.exp(x * 0.5 + bias)
    np.testing.assert_allclose(e, ref, rtol=1e-6)
    np.testing.assert_allclose(acc[:, 0], 2 * ref.sum(axis=1), rtol=1e-5)


@pytest.mark.parametrize("op, fn", [(nl.gelu_apprx_tanh, lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))),
                                    (nl.silu, lambda x: x / (1 + np.exp(-x))), (nl.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
                                    (nl.gelu, None), (nl.square, np.square)])
def test_activation_functions(op, fn):
    x = rand(16, 32)
    if fn is None:
        import math
        fn = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    out = on_chip(lambda d, t: nisa.activation(dst=d, op=op, data=t), x)
    np.testing.assert_allclose(out, fn(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_tensor_reduce_axes_negate_keepdims():
    x = rand(16, 4, 8)
    out = on_chip(lambda d, t: nisa.tensor_reduce(dst=d, op=nl.add, data=t, axis=2, negate=True), x, shape=(16, 4))
    np.testing.assert_allclose(out, -x.sum(axis=2), rtol=1e-5)
    out = on_chip(lambda d, t: nisa.tensor_reduce(dst=d, op=nl.maximum, data=t, axis=(1, 2), keepdims=True), x,
                  shape=(16, 1, 1))
    np.testing.assert_array_equal(out, x.max(axis=(1, 2), keepdims=True))


def test_reciprocal_iota_affine_select():
    x = np.abs(rand(8, 8)) + 1
    np.testing.assert_allclose(on_chip(lambda d, t: nisa.reciprocal(dst=d, data=t), x), 1 / x, rtol=1e-6)

    @nki.jit
    def kernel(a):
        t = sbuf_in(a)
        idx = nl.ndarray((8, 2, 4), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=idx, pattern=[[10, 2], [1, 4]], offset=3, channel_multiplier=100)
        masked = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)  # causal: keep column <= row
        nisa.affine_select(dst=masked, pattern=[[-1, 8]], channel_multiplier=1, on_true_tile=t,
                           on_false_value=-9999.0, cmp_op=nl.greater_equal)
        return hbm_out(idx), hbm_out(masked)

    idx, masked = nki.simulate(kernel)(x)
    p, w, z = np.meshgrid(np.arange(8), np.arange(2), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(idx, 3 + 100 * p + 10 * w + z)
    np.testing.assert_array_equal(masked, np.where(np.tril(np.ones((8, 8))) > 0, x, -9999.0))


def test_range_select_and_select_reduce():
    x = rand(4, 16)
    lo, hi = np.array([[0], [2], [5], [15]], np.float32), np.array([[4], [2], [9], [16]], np.float32)

    @nki.jit
    def kernel(a, l, h):
        t, lt, ht = sbuf_in(a), sbuf_in(l), sbuf_in(h)
        out = nl.ndarray((4, 16), nl.float32, buffer=nl.sbuf)
        mx = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=out, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=lt,
                          bound1=ht, reduce_res=mx, reduce_op=nl.maximum, range_start=0)
        return hbm_out(out), hbm_out(mx)

    out, mx = nki.simulate(kernel)(x, lo, hi)
    cols = np.arange(16)[None, :]
    ref = np.where((cols >= lo) & (cols < hi), x, np.float32(-3.4028235e38))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(mx[:, 0], ref.max(axis=1))


def test_max8_and_find_index8():
    x = rand(16, 100)

    @nki.jit
    def kernel(a):
        t = sbuf_in(a)
        top = nl.ndarray((16, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=top, src=t)
        idx = nl.ndarray((16, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx, data=t, vals=top)
        return hbm_out(top), hbm_out(idx)

    top, idx = nki.simulate(kernel)(x)
    np.testing.assert_array_equal(top, -np.sort(-x, axis=1)[:, :8])
    np.testing.assert_array_equal(idx, np.argsort(-x, axis=1, kind="stable")[:, :8])


def test_bn_stats_then_bn_aggr_give_mean_and_variance():
    x = rand(8, 300)

    @nki.jit
    def kernel(a):
        t = sbuf_in(a)
        stats = nl.ndarray((8, 12), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=stats[:, 0:6], data=t[:, 0:150])
        nisa.bn_stats(dst=stats[:, 6:12], data=t[:, 150:300])
        mv = nl.ndarray((8, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv, data=stats)
        return hbm_out(mv)

    mv = nki.simulate(kernel)(x)
    np.testing.assert_allclose(mv[:, 0], x.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mv[:, 1], x.var(axis=1), rtol=1e-5)


# -- Tensor Engine -------------------------------------------------------------------------------------------


def test_nc_matmul_computes_stationary_transposed_times_moving_into_psum():
    s, m = rand(128, 64), rand(128, 200)

    def body(dst, st, mv):
        p = nl.ndarray((64, 200), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=st, moving=mv)
        nisa.tensor_copy(dst=dst, src=p)

    out = on_chip(body, s, m, shape=(64, 200))
    np.testing.assert_allclose(out, s.T @ m, rtol=1e-4, atol=1e-4)


def test_nc_matmul_accumulates_until_the_psum_tile_is_read():
    """accumulate=None: the first matmul into a PSUM location overwrites, later ones accumulate;
    after the result is read, the next matmul starts a new group; accumulate=False overwrites."""
    a, b = rand(32, 16), rand(32, 8)

    @nki.jit
    def kernel(x, y):
        st, mv = sbuf_in(x), sbuf_in(y)
        p = nl.ndarray((16, 8), nl.float32, buffer=nl.psum)
        r1, r2, r3 = (nl.ndarray((16, 8), nl.float32, buffer=nl.sbuf) for _ in range(3))
        nisa.nc_matmul(dst=p, stationary=st, moving=mv)
        nisa.nc_matmul(dst=p, stationary=st, moving=mv)
        nisa.tensor_copy(dst=r1, src=p)  # 2 x
        nisa.nc_matmul(dst=p, stationary=st, moving=mv)
        nisa.tensor_copy(dst=r2, src=p)  # a new group: 1 x
        nisa.nc_matmul(dst=p, stationary=st, moving=mv, accumulate=True)
        nisa.nc_matmul(dst=p, stationary=st, moving=mv, accumulate=False)
        nisa.tensor_copy(dst=r3, src=p)  # overwritten: 1 x
        return hbm_out(r1), hbm_out(r2), hbm_out(r3)

    r1, r2, r3 = nki.simulate(kernel)(a, b)
    ref = a.T @ b
    np.testing.assert_allclose(r1, 2 * ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r2, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r3, ref, rtol=1e-5, atol=1e-5)


def test_nc_transpose_on_tensor_and_vector_engines():
    x = rand(96, 40, dtype=ml_dtypes.bfloat16)

    def body(dst, t):
        p = nl.ndarray((40, 96), t.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=t)
        nisa.tensor_copy(dst=dst, src=p)

    np.testing.assert_array_equal(on_chip(body, x, shape=(40, 96), dtype=ml_dtypes.bfloat16), x.T)
    y = rand(16, 24)
    out = on_chip(lambda d, t: nisa.nc_transpose(dst=d, data=t, engine=nisa.engine.vector), y, shape=(24, 16))
    np.testing.assert_array_equal(out, y.T)


# -- nki.language ------------------------------------------------------------------------------------------------


def test_language_functions_load_store_add_exp_matmul_softmax():
    x, y, w = rand(64, 128), rand(64, 128), rand(64, 32)

    @nki.jit
    def kernel(a, b, c):
        ta, tb, tc = nl.load(a), nl.load(b), nl.load(c)
        s = nl.add(ta, tb)
        e = nl.exp(nl.multiply(s, 0.1))
        m = nl.matmul(tc, ta, transpose_x=True)  # c.T @ a
        sm = nl.softmax(ta, axis=1)
        outs = [nl.ndarray(t.shape, nl.float32, buffer=nl.shared_hbm) for t in (s, e, m, sm)]
        for o, t in zip(outs, (s, e, m, sm)):
            nl.store(o, t)
        return outs

    s, e, m, sm = nki.simulate(kernel)(x, y, w)
    np.testing.assert_allclose(s, x + y, rtol=1e-6)
    np.testing.assert_allclose(e, np.exp((x + y) * 0.1), rtol=1e-5)
    np.testing.assert_allclose(m, w.T @ x, rtol=1e-4, atol=1e-4)
    ref = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(sm, ref / ref.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_views_follow_the_language_guide():
    @nki.jit
    def kernel():
        t = nl.ndarray((64, 64, 64), dtype=nl.float32, buffer=nl.sbuf)
        assert t[0, 0, 10].shape == (1, 1)
        assert t[:, 0].shape == (64, 64)
        assert t[:, 0, 10].shape == (64, 1)
        assert t[:, :, ::2].shape == (64, 64, 32)
        assert t[0, ..., :].shape == (1, 64, 64)
        h = nl.ndarray((4, 128, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        assert h[0, :, :].shape == (128, 32)
        u = nl.ndarray((128, 4, 16), dtype=nl.float32, buffer=nl.sbuf)
        assert u[0:64, :, :].permute((0, 2, 1))[:, 0, :].shape == (64, 4)
        s = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        assert (s.strides, s.offset, s.ndim, s.size) == ((64, 1), 0, 2, 128 * 64)
        assert s.view(nl.uint8).shape == (128, 256)
        assert s.reshape((128, 8, 8)).shape == (128, 8, 8)
        assert s.ap(pattern=[(64, 128), (2, 32)]).shape == (128, 32)
        assert not s[:, ::2].is_contiguous() and s.is_contiguous()
        # views share storage: writing through one is visible through another
        nisa.memset(dst=s, value=0.0)
        nisa.memset(dst=s.reshape((128, 8, 8))[:, 2, :], value=1.0)
        return hbm_out(s)

    out = nki.simulate(kernel)()
    assert out[:, 16:24].sum() == 128 * 8 and out.sum() == 128 * 8
