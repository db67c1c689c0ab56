"""What the library's NKI kernels share: tiling, loads and stores, transposes, tiled matmuls.

Plain Python functions called from inside ``@nki.jit`` kernels (so inlined into them, as NKI's
compiler inlines them). Conventions: ``P`` = 128 partitions; a row tile is ``rows <= 128`` rows on
the partitions; compute tiles are float32 in SBUF; a matmul's operands are in the kernel's
*matmul dtype* (bfloat16 for bfloat16 inputs, else float32, which the Tensor Engine runs at a
quarter of the rate) and its results float32 in PSUM.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

P = 128  # partitions (nl.tile_size.pmax)
FMAX = 512  # a matmul's moving free size, one PSUM bank of float32 (nl.tile_size.gemm_moving_fmax)


def spans(total: int, size: int):
    """``(start, length)`` of consecutive pieces of ``size`` covering ``range(total)``."""
    return [(start, min(size, total - start)) for start in range(0, total, size)]


def matmul_dtype(dtype):
    return nl.bfloat16 if dtype == nl.bfloat16 else nl.float32


def sbuf(shape, dtype=nl.float32, name=""):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.sbuf, name=name)


def psum(shape, name=""):
    return nl.ndarray(tuple(shape), nl.float32, buffer=nl.psum, name=name)


def hbm(shape, dtype):
    return nl.ndarray(tuple(shape), dtype, buffer=nl.shared_hbm)


def load(src, dtype=nl.float32, name=""):
    """An HBM view into a fresh SBUF tile of ``dtype`` (the DMA casts)."""
    tile = sbuf(src.shape, dtype, name)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def load_rows(src, rows: int, dtype=nl.float32, name=""):
    """A [1, F] HBM view broadcast to ``rows`` partitions (a weight every row uses)."""
    tile = sbuf((rows, src.shape[-1]), dtype, name)
    nisa.dma_copy(dst=tile, src=src.reshape((1, src.shape[-1])).broadcast(0, rows))
    return tile


def column(rows: int, value: float, dtype=nl.float32):
    """A [rows, 1] tile of a constant."""
    tile = sbuf((rows, 1), dtype)
    nisa.memset(dst=tile, value=value)
    return tile


def transpose(src, dtype=None):
    """``src`` [p, f] (p, f <= 128) transposed into a fresh SBUF tile [f, p], through PSUM on the
    Tensor Engine."""
    p, f = src.shape
    dtype = dtype or src.dtype
    staged = src
    if src.dtype != dtype:
        staged = sbuf((p, f), dtype)
        nisa.tensor_copy(dst=staged, src=src)
    flipped = nl.ndarray((f, p), dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=flipped, data=staged)
    out = sbuf((f, p), dtype)
    nisa.tensor_copy(dst=out, src=flipped)
    return out


def load_transposed(dst, src):
    """An HBM view ``src`` [a, b] (a, b <= 128) into the SBUF view ``dst`` [b, a]: a DMA
    transpose when the dtypes agree, else a load, a Tensor Engine transpose and a copy."""
    if src.dtype == dst.dtype:
        nisa.dma_transpose(dst=dst, src=src)
    else:
        nisa.tensor_copy(dst=dst, src=transpose(load(src, dst.dtype)))
    return dst


def transposed_chunks(tile, dtype):
    """A tile [rows, K] as its transposed 128-column chunks: ``[(k0, kc, [kc, rows])...]``,
    the stationary operands of ``tile @ W``."""
    return [(k0, kc, transpose(tile[:, k0:k0 + kc], dtype)) for k0, kc in spans(tile.shape[1], P)]


def matmul_rows(lhs_t, rhs, n0: int, nc: int, out_psum, first: bool = True):
    """``out_psum [rows, nc] = lhs @ rhs[:, n0:n0 + nc]`` with ``lhs`` given as its transposed
    chunks (``transposed_chunks``) and ``rhs`` an SBUF tile [K, N] or an HBM view [K, N]
    (loaded chunk by chunk in the matmul dtype), accumulating over K in PSUM (onto what is
    there already unless ``first``)."""
    for index, (k0, kc, chunk) in enumerate(lhs_t):
        moving = rhs[k0:k0 + kc, n0:n0 + nc]
        if not moving.on_chip or moving.dtype != chunk.dtype:
            moving = load(moving, chunk.dtype)
        nisa.nc_matmul(dst=out_psum, stationary=chunk, moving=moving, accumulate=not (first and index == 0))
    return out_psum


def linear_t(lhs_t, weight, n0: int, nc: int, out_psum):
    """``out_psum [rows, nc] = lhs @ weight.T[:, n0:n0 + nc]`` for ``weight`` an HBM tensor in
    ``nn.Linear`` layout [N, K]: its blocks transposed on the way in."""
    for index, (k0, kc, chunk) in enumerate(lhs_t):
        moving = sbuf((kc, nc), chunk.dtype)
        for m0, mc in spans(nc, P):
            load_transposed(moving[:, m0:m0 + mc], weight[n0 + m0:n0 + m0 + mc, k0:k0 + kc])
        nisa.nc_matmul(dst=out_psum, stationary=chunk, moving=moving, accumulate=index > 0)
    return out_psum


def row_sums_into(acc, lhs, rhs):
    """``acc [M, N] += lhs.T @ rhs`` for tiles ``lhs`` [rows, M] (M <= 128), ``rhs`` [rows, N]:
    a contraction over the rows (a weight gradient), N in 512-column pieces."""
    for c0, cols in spans(rhs.shape[1], FMAX):
        part = psum((lhs.shape[1], cols))
        nisa.nc_matmul(dst=part, stationary=lhs, moving=rhs[:, c0:c0 + cols])
        nisa.tensor_tensor(dst=acc[:, c0:c0 + cols], data1=acc[:, c0:c0 + cols], data2=part, op=nl.add)
