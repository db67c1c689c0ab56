"""NKI kernels on neuron tensors: one kernel launch each, in strict and adaptive eager and in
compiled mode, timed by the kernel's own schedule; ``torch_neuronx.nki_op`` (a kernel as a
PyTorch custom operator, with autograd and in-place updates); errors at the call when the host
can see them, deferred to the next sync point when only the data shows them."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch

import adaptive_eager
import nki
import nki.isa as nisa
import nki.language as nl
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.hardware.execution_queue import QUEUE
from conftest import on_device, windows_at_sync_points
from torch_neuronx import nki_op

RUNS = {"scale_rows": 0}


@nki.jit
def scale_rows(x, w):
    """out[i, :] = x[i, :] * w[i]: rows tiled by 128, a per-partition scalar multiply."""
    RUNS["scale_rows"] += 1
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(x.shape[0] // nl.tile_size.pmax):
        rows = slice(i * 128, (i + 1) * 128)
        t = nl.ndarray((128, x.shape[1]), x.dtype, buffer=nl.sbuf)
        s = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[rows, :])
        nisa.dma_copy(dst=s, src=w[rows, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=s)
        nisa.dma_copy(dst=out[rows, :], src=t)
    return out


@nki.jit
def add_kernel(a, b):
    assert a.shape == b.shape, "add_kernel: a and b must have one shape"  # <- the kernel's own check
    ta = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    tb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ta, src=a)
    nisa.dma_copy(dst=tb, src=b)
    nisa.tensor_tensor(dst=ta, data1=ta, data2=tb, op=nl.add)
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=ta)
    return out


@nki.jit
def mul_scalar(a, factor):
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=factor)
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def axpy_(y, x, a):
    """y += a * x in place (an output argument, as nki-library's kernels take them); returns y."""
    ty = nl.ndarray(y.shape, y.dtype, buffer=nl.sbuf)
    tx = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ty, src=y)
    nisa.dma_copy(dst=tx, src=x)
    nisa.scalar_tensor_tensor(dst=ty, data=tx, op0=nl.multiply, operand0=a, op1=nl.add, operand1=ty)
    nisa.dma_copy(dst=y, src=ty)
    return y


@nki.jit
def gather_rows(table, idx):
    """table[idx[:, 0]]: an indirect DMA whose row indices are data."""
    n, f = idx.shape[0], table.shape[1]
    ix = nl.ndarray((n, 1), idx.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ix, src=idx)
    t = nl.ndarray((n, f), table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=table.ap(pattern=[[f, n], [1, f]], vector_offset=ix, indirect_dim=0))  # <- gather
    out = nl.ndarray((n, f), table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def too_many_partitions(a):
    t = nl.ndarray((a.shape[0], a.shape[1]), a.dtype, buffer=nl.sbuf)  # <- too tall
    nisa.dma_copy(dst=t, src=a)
    return a


def line_of(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def kernel_stats(name):
    return adaptive_eager.stats()["kernels"].get(f"nki::{name}")


# -- one launch, the kernel's own time ----------------------------------------------------------------------


def test_a_kernel_on_neuron_tensors_is_one_launch_timed_by_its_schedule(any_mode):
    x, w = torch.randn(256, 64), torch.randn(256, 1)
    xd, wd = on_device(x, w)
    y = scale_rows(xd, wd)
    assert y.device.type == "neuron" and y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.cpu(), x * w)
    stats = adaptive_eager.stats()
    assert stats["kernels_launched"] == 1
    run = nki.run(scale_rows, x.numpy(), w.numpy())  # time_us: the schedule plus one launch
    assert kernel_stats("scale_rows") == {"launches": 1, "time_us": round(run.time_us, 3), "bytes": 132096}
    expected = CONFIG.launch_us + run.schedule.device_ns / 1000  # the same sum, in the device's order
    assert QUEUE.kernel_summary()["nki::scale_rows"][1] == expected  # exactly
    assert COUNTERS.device_time_us == expected and expected == pytest.approx(run.time_us, rel=1e-12)


def test_the_launch_is_the_devices(strict_mode):
    """A kernel's time is its schedule plus the device's launch overhead (NEURON_SIM_LAUNCH_US),
    exactly as any kernel's."""
    x, w = torch.randn(384, 32), torch.randn(384, 1)
    xd, wd = on_device(x, w)
    saved = CONFIG.launch_us
    CONFIG.launch_us = 3.0
    try:
        scale_rows(xd, wd)
        torch.neuron.synchronize()
    finally:
        CONFIG.launch_us = saved
    schedule = nki.run(scale_rows, x.numpy(), w.numpy()).schedule
    assert COUNTERS.device_time_us == schedule.device_ns / 1000 + 3.0


def test_the_trial_runs_once_per_form_and_shapes(strict_mode):
    """The kernel runs on the host once per input shapes (its trial, which raises what the host
    can see and gives the shapes and the schedule), then once per call on the device worker."""
    x, w = torch.randn(128, 48), torch.randn(128, 1)
    xd, wd = on_device(x, w)
    RUNS["scale_rows"] = 0
    scale_rows(xd, wd)
    scale_rows(xd, wd)
    torch.neuron.synchronize()
    assert RUNS["scale_rows"] == 3
    scale_rows(xd[:, :16].contiguous(), wd)
    torch.neuron.synchronize()
    assert RUNS["scale_rows"] == 5


def test_non_tensor_arguments_select_the_kernels_form(strict_mode):
    """Non-tensor arguments are compile-time constants of the kernel, keyed by value, as
    TorchNeuron compiles a kernel per non-tensor argument values."""
    a = torch.randn(64, 32)
    (ad,) = on_device(a)
    torch.testing.assert_close(mul_scalar(ad, 2.0).cpu(), a * 2.0)
    torch.testing.assert_close(mul_scalar(ad, 0.5).cpu(), a * 0.5)
    torch.testing.assert_close(mul_scalar(ad, factor=2.0).cpu(), a * 2.0)
    assert kernel_stats("mul_scalar")["launches"] == 3


def test_bfloat16_runs_on_the_storage_bytes(any_mode):
    a, b = torch.randn(128, 40).bfloat16(), torch.randn(128, 40).bfloat16()
    ad, bd = on_device(a, b)
    c = add_kernel(ad, bd)
    assert c.dtype == torch.bfloat16
    expected = nki.simulate(add_kernel)(a.view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                                        b.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    assert torch.equal(c.cpu(), torch.from_numpy(expected.view(np.int16)).view(torch.bfloat16))


def test_a_view_argument_is_read_through_its_strides(any_mode):
    base = torch.randn(64, 128)
    (bd,) = on_device(base)
    left, right = bd[:, :64], bd.t()[:64, :]  # a column slice and a transposed view
    torch.testing.assert_close(add_kernel(left, right).cpu(), base[:, :64] + base.t()[:64, :])


def test_written_arguments_are_written_in_place_and_ordered(any_mode):
    """A kernel writing an argument: its op marks it written (so the window orders its readers
    after it), its version counter moves, and a returned argument is the caller's tensor."""
    y0, x = torch.randn(128, 32), torch.randn(128, 32)
    yd, xd = on_device(y0, x)
    before = yd._version
    doubled = xd * 2
    returned = axpy_(yd, doubled, 0.5)
    after = yd + 1
    assert returned is yd and yd._version == before + 1
    torch.testing.assert_close(after.cpu(), y0 + x + 1)
    torch.testing.assert_close(yd.cpu(), y0 + x)
    assert kernel_stats("axpy_")["launches"] == 1


def test_the_planner_never_fuses_a_kernel(adaptive_mode):
    """In a window the kernel stays one launch of its own; the on-chip rule (which lets small
    ops of any category share a kernel) does not take it either: it has the NeuronCore to itself."""
    gen = windows_at_sync_points()
    next(gen)
    try:
        a, b = torch.randn(128, 16), torch.randn(128, 16)
        ad, bd = on_device(a, b)
        out = add_kernel(ad * 2, bd) + 1
        torch.testing.assert_close(out.cpu(), a * 2 + b + 1)
        stats = adaptive_eager.stats()
        assert stats["kernels_launched"] == 3 and stats["fused_kernels"] == 0
        assert set(stats["kernels"]) == {"aten::mul", "nki::add_kernel", "aten::add"}
    finally:
        gen.close()


def test_direct_calls_are_one_node_under_torch_compile():
    def f(a, b):
        return add_kernel(a, b).relu() * 2

    a, b = torch.randn(128, 64), torch.randn(128, 64)
    ad, bd = on_device(a, b)
    compiled = torch.compile(f, backend="neuron", fullgraph=True)  # fullgraph: no graph break
    torch.testing.assert_close(compiled(ad, bd).cpu(), f(a, b))
    stats = adaptive_eager.stats()
    assert kernel_stats("add_kernel")["launches"] == 1 and stats["kernels_launched"] == 2  # the kernel, relu|mul


# -- errors ---------------------------------------------------------------------------------------------------


def test_errors_the_host_can_see_raise_at_the_call(strict_mode):
    a, b = torch.randn(256, 8), torch.randn(128, 8)
    ad, bd = on_device(a, b)
    with pytest.raises(nisa.NkiValidationError, match="partition dimension 256 exceeds maximum 128") as info:
        too_many_partitions(ad)
    assert info.traceback[-1].lineno + 1 == line_of(too_many_partitions, "# <- too tall")  # the kernel's line
    with pytest.raises(AssertionError, match="a and b must have one shape"):
        add_kernel(ad, bd)
    wide = ad.double()
    with pytest.raises(TypeError, match="torch.float64, which NKI has no type for"):
        add_kernel(wide, wide)
    with pytest.raises(RuntimeError, match="must be on the neuron device"):
        add_kernel(bd, b)
    torch.neuron.synchronize()
    assert list(adaptive_eager.stats()["kernels"]) == ["aten::_to_copy"]  # .double(); no kernel launched


def test_errors_only_the_data_shows_are_deferred_naming_kernel_instruction_and_line(any_mode):
    table = torch.randn(50, 16)
    td, bad, good = on_device(table, torch.tensor([[3], [70], [1]], dtype=torch.int32),
                              torch.tensor([[3], [7], [1]], dtype=torch.int32))
    rows = gather_rows(td, bad); issued = line_of(test_errors_only_the_data_shows_are_deferred_naming_kernel_instruction_and_line, "rows = gather_rows(td, bad)")  # noqa: E702
    later = rows + 1  # issued after the failure: dropped, its output poisoned
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as info:
        later.cpu()
    message = str(info.value)
    assert info.value.op_name == "nki::gather_rows"
    assert f"{os.path.basename(__file__)}:{issued}" in message  # the user's line
    assert "dma_copy: out-of-bounds access" in message  # the instruction
    kernel_line = line_of(gather_rows, "# <- gather")
    assert f"test_nki_on_device.py:{kernel_line} in gather_rows" in message  # the kernel's line
    torch.testing.assert_close(gather_rows(td, good).cpu(), table[[3, 7, 1]])  # the device goes on


# -- nki_op: TorchNeuron's custom operators -------------------------------------------------------------------


@nki_op("nkitest::add", mutates_args=())
def nki_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return add_kernel(a, b)


@nki_op("nkitest::scale", mutates_args=())
def nki_scale(a: torch.Tensor, factor: float) -> torch.Tensor:
    return mul_scalar(a, factor)


@nki_op("nkitest::scaled_add", mutates_args=())
def nki_scaled_add(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * a + b: one kernel in the forward pass, one in the backward pass."""
    return axpy_(b.clone(), a, alpha)


def _scaled_add_setup(ctx, inputs, output):
    ctx.alpha = inputs[2]


def _scaled_add_backward(ctx, grad):
    return nki_scale(grad, ctx.alpha), grad, None


nki_scaled_add.register_autograd(_scaled_add_backward, setup_context=_scaled_add_setup)


@nki_op("nkitest::axpy_", mutates_args=("y",))
def nki_axpy_(y: torch.Tensor, x: torch.Tensor, alpha: float) -> None:
    axpy_(y, x, alpha)


def test_nki_op_is_a_pytorch_custom_operator_with_the_kernels_shapes():
    assert torch.ops.nkitest.add.default._schema.name == "nkitest::add"
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = torch.randn(128, 24)
    (ad,) = on_device(a)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(ad)
        out = torch.ops.nkitest.add(fake, fake)
        assert out.shape == (128, 24) and out.device.type == "neuron"
    assert adaptive_eager.stats()["kernels_launched"] == 0  # fake: nothing ran
    # on CPU tensors the kernel runs on the simulator
    torch.testing.assert_close(nki_add(a, a), a + a)


def test_nki_op_traces_on_cpu_tensors_too():
    """Traced on CPU FakeTensors (torch.compile of CPU code), a kernel call gives its shapes from
    its trial; run, it runs on the simulator."""
    a = torch.randn(64, 16)
    compiled = torch.compile(lambda x: nki_add(x, x) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(a), (a + a) * 2)


@pytest.mark.parametrize("mode", ["strict", "adaptive", "compiled"])
def test_nki_op_trains(mode):
    """Forward and backward, each kernel one launch, gradients equal to the plain PyTorch ones."""
    a, b = torch.randn(128, 32), torch.randn(128, 32)

    def loss_of(a, b):
        return (nki_scaled_add(a, b, 0.25).relu() * 3).sum()

    def reference(a, b):
        return ((0.25 * a + b).relu() * 3).sum()

    ca, cb = a.clone().requires_grad_(), b.clone().requires_grad_()
    reference(ca, cb).backward()
    ad, bd = (t.requires_grad_() for t in on_device(a, b))
    adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    fn = torch.compile(loss_of, backend="neuron") if mode == "compiled" else loss_of
    loss = fn(ad, bd)
    loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), reference(a, b))
    torch.testing.assert_close(ad.grad.cpu(), ca.grad)
    torch.testing.assert_close(bd.grad.cpu(), cb.grad)
    kernels = adaptive_eager.stats()["kernels"]
    assert kernels["nki::axpy_"]["launches"] == 1 and kernels["nki::mul_scalar"]["launches"] == 1


@pytest.mark.parametrize("mode", ["strict", "adaptive", "compiled"])
def test_nki_op_updates_in_place(mode):
    """``mutates_args``: the kernel writes the argument; in a compiled graph it writes the
    input's buffer too (no clone of it, no copy back)."""
    y0, x = torch.randn(128, 32), torch.randn(128, 32)
    yd, xd = on_device(y0, x)

    def step(y, x):
        nki_axpy_(y, x, 0.5)
        return y * 2

    adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    fn = torch.compile(step, backend="neuron", fullgraph=True) if mode == "compiled" else step
    out = fn(yd, xd)
    torch.testing.assert_close(yd.cpu(), y0 + 0.5 * x)
    torch.testing.assert_close(out.cpu(), 2 * (y0 + 0.5 * x))
    assert set(adaptive_eager.stats()["kernels"]) == {"nki::axpy_", "aten::mul"}
    assert adaptive_eager.stats()["kernels_launched"] == 2


# -- packaging -------------------------------------------------------------------------------------------------


def test_torch_neuronx_nki_is_whichever_nki_is_installed(tmp_path):
    """``torch_neuronx.nki`` is ``import nki``: a real NKI when one is installed (ours steps
    aside for it); importing torch_neuronx does not import nki until it is asked for."""
    root = tmp_path / "real"
    dist = root / "nki-0.3.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nki\nVersion: 0.3.0\n")
    (dist / "top_level.txt").write_text("nki\n")
    (root / "nki").mkdir()
    (root / "nki" / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent("""
        import sys, torch_neuronx
        print('nki' in sys.modules, callable(torch_neuronx.nki_op), getattr(torch_neuronx.nki, 'REAL', False))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.stdout.split() == ["False", "True", "True"], out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "True", "False"], out.stderr
