"""Whole kernels on the simulated NKI, the ``nki.simulate`` / ``nki.run`` contract, the trace and
the cost model, and the packaging rule (never shadow a real ``nki``)."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki import cost

RNG = np.random.default_rng(1)


# -- kernels written here ---------------------------------------------------------------------------------------


@nki.jit
def tiled_add(a, b):
    """c = a + b for [N, F] tensors, N a multiple of 128, F tiled by 512."""
    n, f = a.shape
    c = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n // nl.tile_size.pmax):
        rows = slice(i * 128, (i + 1) * 128)
        for j in nl.affine_range((f + 511) // 512):
            cols = slice(j * 512, min(f, (j + 1) * 512))
            width = cols.stop - cols.start
            ta = nl.ndarray((128, width), dtype=a.dtype, buffer=nl.sbuf)
            tb = nl.ndarray((128, width), dtype=b.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=ta, src=a[rows, cols])
            nisa.dma_copy(dst=tb, src=b[rows, cols])
            nisa.tensor_tensor(dst=ta, data1=ta, data2=tb, op=nl.add)
            nisa.dma_copy(dst=c[rows, cols], src=ta)
    return c


@nki.jit
def softmax_rows(x):
    """Row softmax of a [128, F] tensor with ISA instructions."""
    p, f = x.shape
    t = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    neg_max = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=t, axis=1, negate=True)
    total = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=t, op=nl.exp, data=t, bias=neg_max, reduce_op=nl.add, reduce_res=total,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.reciprocal(dst=total, data=total)
    out = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out, data=t, op0=nl.multiply, operand0=total)
    result = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=result, src=out)
    return result


@nki.jit
def matmul_k_tiled(lhs_t, rhs):
    """lhs_t.T @ rhs for lhs_t [K, M<=128], rhs [K, N<=512]: K tiles of 128 accumulate in one PSUM tile."""
    k, m = lhs_t.shape
    _, n = rhs.shape
    acc = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
    for i in nl.sequential_range(k // 128):
        a = nl.ndarray((128, m), dtype=lhs_t.dtype, buffer=nl.sbuf)
        b = nl.ndarray((128, n), dtype=rhs.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=lhs_t[i * 128:(i + 1) * 128, :])
        nisa.dma_copy(dst=b, src=rhs[i * 128:(i + 1) * 128, :])
        nisa.nc_matmul(dst=acc, stationary=a, moving=b)
    out_sb = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out_sb, src=acc)
    out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=out_sb)
    return out


@nki.jit
def cumsum_scan(x):
    """Cumulative sum along the free axis of [P<=128, F] with tensor_tensor_scan, F tiled by 256
    with the last column carried between tiles."""
    p, f = x.shape
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    carry = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=carry, value=0.0)
    ones = nl.ndarray((p, 256), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    for j in nl.sequential_range(f // 256):
        t = nl.ndarray((p, 256), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[:, j * 256:(j + 1) * 256])
        r = nl.ndarray((p, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=r, data0=ones, data1=t, initial=carry, op0=nl.multiply, op1=nl.add)
        nisa.tensor_copy(dst=carry, src=r[:, 255:256])
        nisa.dma_copy(dst=out[:, j * 256:(j + 1) * 256], src=r)
    return out


def test_tiled_add():
    a, b = RNG.standard_normal((256, 1300)).astype(np.float32), RNG.standard_normal((256, 1300)).astype(np.float32)
    np.testing.assert_array_equal(nki.simulate(tiled_add)(a, b), a + b)


def test_softmax():
    x = (RNG.standard_normal((128, 700)) * 3).astype(np.float32)
    ref = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(nki.simulate(softmax_rows)(x), ref / ref.sum(axis=1, keepdims=True), rtol=1e-5,
                               atol=1e-8)


def test_matmul_accumulating_over_k_tiles_in_psum():
    a = RNG.standard_normal((1024, 96)).astype(ml_dtypes.bfloat16)
    b = RNG.standard_normal((1024, 384)).astype(ml_dtypes.bfloat16)
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    np.testing.assert_allclose(nki.simulate(matmul_k_tiled)(a, b), ref, rtol=2e-4, atol=2e-3)


def test_cumsum_with_tensor_tensor_scan():
    x = RNG.standard_normal((100, 1024)).astype(np.float32)
    np.testing.assert_allclose(nki.simulate(cumsum_scan)(x), np.cumsum(x, axis=1), rtol=1e-4, atol=1e-4)


# -- the simulate / run contract -------------------------------------------------------------------------------------


def test_simulate_updates_input_arrays_the_kernel_writes():
    @nki.jit
    def scale_into(x, out):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out, src=t)

    x, out = np.ones((4, 8), np.float32), np.zeros((4, 8), np.float32)
    assert nki.simulate(scale_into)(x, out) is None
    assert (out == 2).all() and (x == 1).all()
    strided = np.zeros((4, 8), np.float32)[:, ::2]  # not contiguous: written back after the run
    nki.simulate(scale_into)(x[:, :4], strided)
    assert (strided == 2).all()


def test_simulate_takes_torch_cpu_tensors_and_plain_functions():
    torch = pytest.importorskip("torch")

    def double(x):  # no @nki.jit: simulate wraps it
        t = nl.load(x)
        y = nl.multiply(t, 2.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, y)
        return out

    x = torch.randn(16, 32, dtype=torch.bfloat16)
    y = nki.simulate(double)(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert torch.equal(y, x * 2)


def test_spmd_launch_gives_each_program_its_id_and_shares_outputs():
    @nki.jit
    def halves(x):
        n = nl.num_programs()
        pid = nl.program_id(0)
        rows = x.shape[0] // n
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[pid * rows:(pid + 1) * rows, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(pid + 1))
        nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows, :], src=t)
        return out

    x = np.zeros((256, 16), np.float32)
    y = nki.simulate(halves[2])(x)
    assert (y[:128] == 1).all() and (y[128:] == 2).all()
    assert nki.run(halves[2], x).schedule.count["DMA"] == 4


def test_sendrecv_and_barrier_between_two_programs():
    @nki.jit
    def swap(x):
        pid = nl.program_id(0)
        mine = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=mine, value=float(pid))
        theirs = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        out = nl.ndarray((2, 4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid], src=theirs)
        nisa.core_barrier(out, (0, 1))
        return out

    out = nki.simulate(swap[2])(np.zeros(1, np.float32))
    assert (out[0] == 1).all() and (out[1] == 0).all()


# -- trace and cost ---------------------------------------------------------------------------------------------------


def test_trace_records_each_instruction_with_engine_shapes_bytes_and_line():
    a = np.ones((128, 512), np.float32)
    result = nki.run(tiled_add, a, a)
    names = [(i.name, i.engine) for i in result.trace]
    assert names == [("dma_copy", "DMA"), ("dma_copy", "DMA"), ("tensor_tensor", "VectorE"), ("dma_copy", "DMA")]
    add = result.trace[2]
    assert add.shapes == ((128, 512),) * 3 and add.dtypes == ("float32",) * 3
    assert add.bytes == 3 * 128 * 512 * 4 and add.elements == 512 and add.partitions == 128
    lines, first = inspect.getsourcelines(tiled_add.fn)
    expected = first + next(i for i, text in enumerate(lines) if "nisa.tensor_tensor(" in text)
    assert add.line == f"{__file__}:{expected}"
    outputs, trace, time_us = result  # the shape a later integration calls
    assert trace is result.trace and time_us == result.schedule.total_us


def test_instruction_costs_follow_the_cited_formulas():
    a16 = np.ones((256, 128), ml_dtypes.bfloat16)
    b16 = np.ones((256, 512), ml_dtypes.bfloat16)
    mm16 = [i for i in nki.run(matmul_k_tiled, a16, b16).trace if i.name == "nc_matmul"]
    mm32 = [i for i in nki.run(matmul_k_tiled, a16.astype(np.float32), b16.astype(np.float32)).trace
            if i.name == "nc_matmul"]
    assert len(mm16) == 2
    # max(min(64, N_stationary), N_moving) TensorE cycles at 2.4 GHz; float32 x4
    assert mm16[0].cost_ns == pytest.approx(512 / 2.4) and mm32[0].cost_ns == pytest.approx(4 * 512 / 2.4)
    dma = nki.run(tiled_add, np.ones((128, 512), np.float32), np.ones((128, 512), np.float32)).trace[0]
    assert dma.cost_ns == pytest.approx(128 * 512 * 4 / (16 * 23.0))  # 16 engines x 23 B/ns
    assert all(source for _, _, _, source in cost.FIGURES)


def test_the_schedule_overlaps_engines_and_serialises_dependencies():
    @nki.jit
    def independent(x):
        a = nl.ndarray((128, 4096), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)  # DMA
        b = nl.ndarray((128, 4096), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=b, value=1.0)  # VectorE, independent of the DMA
        c = nl.ndarray((128, 4096), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=c, op=nl.exp, data=b)  # ScalarE, after the memset
        return None

    r = nki.run(independent, np.ones((128, 4096), np.float32), launch=False)
    dma, memset, act = r.trace
    assert memset.start_ns == 0.0 and dma.start_ns == 0.0  # different engines run together
    assert act.start_ns == pytest.approx(memset.end_ns)  # read-after-write waits
    assert r.schedule.device_ns == pytest.approx(max(dma.end_ns, act.end_ns))
    assert r.schedule.device_ns < sum(i.cost_ns for i in r.trace) + cost.DMA_LATENCY_NS
    with_launch = nki.run(independent, np.ones((128, 4096), np.float32))
    assert with_launch.schedule.total_ns == pytest.approx(r.schedule.device_ns + cost.LAUNCH_US * 1000)


# -- packaging -------------------------------------------------------------------------------------------------------


def _fake_nki(root, with_package=True):
    dist = root / "nki-0.3.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nki\nVersion: 0.3.0\n")
    (dist / "top_level.txt").write_text("nki\n")
    if with_package:
        (root / "nki").mkdir()
        (root / "nki" / "__init__.py").write_text("REAL = True\n")


def _import_ours(extra_path):
    here = os.path.dirname(nki.__file__)
    return textwrap.dedent(f"""
        import importlib.util, sys, warnings
        sys.path.append({str(extra_path)!r})
        spec = importlib.util.spec_from_file_location("nki", {os.path.join(here, "__init__.py")!r},
                                                      submodule_search_locations=[{here!r}])
        module = importlib.util.module_from_spec(spec)
        sys.modules["nki"] = module
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                spec.loader.exec_module(module)
            except ImportError as error:
                print("ImportError", error)
                raise SystemExit(0)
        import nki
        print(getattr(nki, "REAL", False), [str(w.message) for w in caught if w.category is RuntimeWarning])
    """)


def test_a_real_nki_wins(tmp_path):
    """Where another distribution provides ``nki``, ours never shadows it (the rule torch_neuronx
    follows, device/compat_names.py): found first on sys.path; imported anyway, it warns and loads
    the other one, or refuses when there is none to load."""
    _fake_nki(tmp_path / "real")
    out = subprocess.run([sys.executable, "-c", "import nki; print(getattr(nki, 'REAL', False))"],
                         capture_output=True, text=True, check=True, cwd="/",
                         env=dict(os.environ, PYTHONPATH=str(tmp_path / "real")))
    assert out.stdout.strip() == "True"
    out = subprocess.run([sys.executable, "-c", _import_ours(tmp_path / "real")], capture_output=True, text=True,
                         check=True, cwd="/")
    real, warned = out.stdout.split(" ", 1)
    assert real == "True", out.stdout + out.stderr
    assert "nki 0.3.0 is installed" in warned and "steps aside" in warned
    _fake_nki(tmp_path / "clobbered", with_package=False)
    out = subprocess.run([sys.executable, "-c", _import_ours(tmp_path / "clobbered")], capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.startswith("ImportError nki: nki 0.3.0 is installed"), out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", _import_ours(tmp_path / "nothing")], capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.strip() == "False []", out.stdout + out.stderr


def test_import_nki_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, nki, nki.isa, nki.language; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "False"


def test_nki_classes_initialise_every_attribute_as_the_language_guide_says():
    """NKI gives an NKIObject class an initialiser over its attributes, annotated or not, those
    without a value defaulting to None (Language Guide, "Class Support"); nki-library relies on it."""
    import dataclasses

    @dataclasses.dataclass
    class Section(nl.NKIObject):
        index = None
        offset = 0
        size: int

    s = Section(index=3, size=7)
    assert (s.index, s.offset, s.size) == (3, 0, 7)
    assert Section().size is None
    assert nisa.get_nc_version() >= nisa.nc_version.gen3 > nisa.nc_version.gen2
