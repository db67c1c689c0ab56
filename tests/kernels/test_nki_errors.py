"""The simulated NKI's errors: hardware constraints broken by a kernel raise an
``NkiValidationError`` naming the instruction, and the innermost traceback frame is the kernel's
own line."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl


def line_of(fn, marker="# <- here"):
    lines, start = inspect.getsourcelines(fn)
    for i, text in enumerate(lines):
        if marker in text:
            return start + i
    raise AssertionError("marker not found")


def raises_at(kernel, *args, match):
    with pytest.raises(nisa.NkiValidationError, match=match) as info:
        nki.simulate(kernel)(*args)
    assert info.traceback[-1].lineno + 1 == line_of(kernel), str(info.traceback[-1])
    assert info.value.location[1] == line_of(kernel)
    assert isinstance(info.value, AssertionError)  # as the SDK simulator raises
    return info.value


X = np.zeros((128, 512), np.float32)


def test_partition_dimension_past_128():
    def kernel(a):
        t = nl.ndarray((256, 512), dtype=nl.float32, buffer=nl.sbuf)  # <- here
        return t

    error = raises_at(kernel, X, match=r"^nl.ndarray: .*partition dimension 256 exceeds maximum 128")
    assert error.instruction == "nl.ndarray"


def test_operand_view_past_128_partitions_in_an_instruction():
    def kernel(a):
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        wide = t.ap(pattern=[[512, 256], [1, 256]])  # a 256-partition access pattern
        out = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=out, data1=wide, data2=wide, op=nl.add)  # <- here
        return out

    raises_at(kernel, X, match=r"^tensor_tensor: data1 partition dimension 256 exceeds maximum 128")


def test_matmul_output_must_be_psum():
    def kernel(a):
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_matmul(dst=out, stationary=t[:, 0:128], moving=t)  # <- here
        return out

    raises_at(kernel, X, match=r"^nc_matmul: dst is in SBUF.*must be in PSUM")


def test_compute_engines_cannot_read_hbm():
    def kernel(a):
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t, data1=a, data2=a, op=nl.add)  # <- here
        return t

    raises_at(kernel, X, match=r"^tensor_tensor: data1 is in HBM.*SBUF or PSUM")


def test_mismatched_shapes():
    def kernel(a):
        t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        out = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=out, data1=t, data2=t, op=nl.multiply)  # <- here
        return out

    raises_at(kernel, X, match=r"^tensor_tensor: dst has 256 elements per partition but data1 has 512")


def test_matmul_moving_free_size_past_one_psum_bank():
    def kernel(a):
        t = nl.ndarray((128, 1024), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)
        p = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=t[:, 0:128], moving=t)  # <- here
        return p

    raises_at(kernel, X, match=r"^nc_matmul: moving free size 1024 exceeds 512")


def test_sbuf_overflow_names_the_allocation_and_the_holders():
    def kernel(a):
        tiles = []
        for i in range(8):  # 8 x 32 KiB per partition > 224 KiB
            tiles.append(nl.ndarray((128, 8192), dtype=nl.float32, buffer=nl.sbuf, name=f"t{i}"))  # <- here
        return tiles[0]

    error = raises_at(kernel, X, match=r"^nl.ndarray: SBUF overflow: 't7' .* needs 32768 bytes per partition")
    assert "229376" in str(error) and "t0" in str(error)


def test_psum_overflow_counts_banks():
    def kernel(a):
        banks = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(8)]  # 8 x 2 KiB
        small = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum)  # <- here
        return banks, small

    raises_at(kernel, X, match=r"^nl.ndarray: PSUM overflow")


def test_tiles_no_longer_referenced_free_their_space():
    """A tile the kernel dropped (rebinding the loop variable) no longer occupies SBUF: 100 tiles
    of 32 KiB per partition in a loop fit, 8 held at once do not (previous test)."""

    @nki.jit
    def kernel(a):
        for i in range(100):
            t = nl.ndarray((128, 8192), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t, value=float(i))
        out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t[:, 0:8])
        return out

    result = nki.run(kernel, X)
    assert (result.outputs == 99).all()
    assert result.sbuf_peak_bytes == 2 * 32768  # the old tile is dropped after the new one exists


def test_explicit_addresses_count_their_interval_once():
    """nki-library's allocator reuses addresses across scopes: overlapping explicit intervals
    occupy their union, not their sum; an address past the partition end is refused."""

    @nki.jit
    def kernel(a):
        held = [nl.ndarray((128, 40000), dtype=nl.float32, buffer=nl.sbuf, address=(0, 0)) for _ in range(5)]
        big = nl.ndarray((128, 1000), dtype=nl.float32, buffer=nl.sbuf, address=(0, 224 * 1024 - 4000))
        return None

    result = nki.run(kernel, X)
    assert result.sbuf_peak_bytes == 160000 + 4000

    def beyond(a):
        t = nl.ndarray((128, 1000), dtype=nl.float32, buffer=nl.sbuf, address=(0, 224 * 1024 - 3999))  # <- here
        return t

    raises_at(beyond, X, match=r"^nl.ndarray: .*outside the SBUF")


def test_accumulating_onto_psum_no_matmul_wrote_is_refused():
    def kernel(a):
        t = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)
        p = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=p, value=0.0)
        nisa.nc_matmul(dst=p, stationary=t, moving=t, accumulate=True)  # <- here
        return p

    raises_at(kernel, X, match=r"^nc_matmul: accumulate=True onto PSUM locations no matmul has written")


def test_errors_in_helper_functions_point_at_the_helper_line():
    def helper(t):
        nisa.iota(dst=t, pattern=[[1, 4]], offset=0)  # <- here

    def kernel(a):
        t = nl.ndarray((8, 8), dtype=nl.int32, buffer=nl.sbuf)
        helper(t)
        return t

    with pytest.raises(nisa.NkiValidationError, match=r"^iota: pattern .* generates 4 elements per partition") as info:
        nki.simulate(kernel)(X)
    assert info.traceback[-1].lineno + 1 == line_of(helper)


def test_instructions_outside_a_kernel_say_so():
    with pytest.raises(nisa.NkiValidationError, match="nl.ndarray: called outside an NKI kernel"):
        nl.ndarray((4, 4), nl.float32)
