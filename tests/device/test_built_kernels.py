"""Built kernels (device/hardware/built_kernel.py): a fused kernel that launches again is built into
one function. Its numbers must stay the CPU's, launch after launch, with new float
constants each time; kernels that update tensors in place stay op by op; a built kernel
that fails still names the exact op and the user's line."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager_device.hardware import built_kernel
from conftest import windows_at_sync_points


@pytest.fixture(autouse=True)
def one_window(adaptive_mode):
    """Each loop iteration is one window, flushed at its sync point; fresh caches."""
    yield from windows_at_sync_points()


@pytest.fixture
def built_runs(monkeypatch):
    """How many launches ran a built kernel."""
    calls = []
    original = built_kernel.BuiltKernel.run

    def run(self, records):
        calls.append(self)
        return original(self, records)

    monkeypatch.setattr(built_kernel.BuiltKernel, "run", run)
    return calls


def chain(x, y, scale):
    h = torch.tanh(x * scale + y)
    return (h * h).sum(-1, keepdim=True) + h.mean()


def test_hot_kernel_is_built_and_keeps_cpu_numbers_with_new_float_constants(built_runs):
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        x, y = torch.randn(32, 16, generator=generator), torch.randn(32, 16, generator=generator)
        scale = 0.5 + step * 0.25  # a float constant that changes every launch
        torch.testing.assert_close(chain(x.to("neuron"), y.to("neuron"), scale).cpu(), chain(x, y, scale))
    cache = adaptive_eager.stats()["kernel_cache"]
    assert cache["built"] == 1 and cache["op_by_op"] == 0
    # built at the second launch (checked against its ops), run as built from the third on
    assert len(built_runs) == 1 + 3


def test_views_of_values_made_inside_the_kernel_are_built():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 24, generator=generator)
    for _ in range(3):
        x = torch.randn(4, 8, 16, generator=generator)
        expected = torch.relu((x.reshape(32, 16) @ weight).view(4, 8, 24).transpose(1, 2) + 1)
        h = (x.to("neuron").reshape(32, 16) @ weight.to("neuron")).view(4, 8, 24).transpose(1, 2)
        torch.testing.assert_close(torch.relu(h + 1).cpu(), expected)
    assert adaptive_eager.stats()["kernel_cache"]["built"] >= 1


def test_kernel_updating_a_tensor_in_place_stays_op_by_op(built_runs):
    """A built run that failed half-way could not be replayed: add_ would add twice."""
    total, expected = torch.zeros(8, 8).to("neuron"), torch.zeros(8, 8)
    for step in range(4):
        x = torch.full((8, 8), float(step))
        total.add_(x.to("neuron") * 2).relu_()
        expected.add_(x * 2).relu_()
        torch.testing.assert_close(total.cpu(), expected)
    cache = adaptive_eager.stats()["kernel_cache"]
    assert cache["op_by_op"] >= 1 and cache["built"] == 0
    assert built_runs == []


def test_overwriting_a_fresh_tensor_is_built():
    """fill_ on a tensor the kernel has not touched before replays safely."""
    for step in range(3):
        x = torch.randn(6, 5)
        ones = torch.empty(6, 5, device="neuron").fill_(1.5)
        torch.testing.assert_close((ones * x.to("neuron")).exp().cpu(), (torch.full((6, 5), 1.5) * x).exp())
    assert adaptive_eager.stats()["kernel_cache"]["built"] == 1


def test_failure_inside_a_built_kernel_names_the_op_and_the_line(built_runs):
    table = torch.randn(10, 4)
    for _ in range(3):
        index = torch.tensor([1, 2, 3])
        out = (table.to("neuron") * 2).index_select(0, index.to("neuron")).exp()
        torch.testing.assert_close(out.cpu(), (table * 2).index_select(0, index).exp())
    assert built_runs  # the kernel is built and in use
    bad = torch.tensor([1, 99, 3])
    line = inspect.currentframe().f_lineno + 1
    out = (table.to("neuron") * 2).index_select(0, bad.to("neuron")).exp()
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as raised:
        out.cpu()
    message = str(raised.value)
    assert "aten::index_select" in message
    assert f"test_built_kernels.py:{line} " in message


def test_building_can_be_turned_off():
    program = (
        "import torch, adaptive_eager\n"
        "x = torch.randn(64)\n"
        "for _ in range(4):\n"
        "    assert torch.allclose((torch.sin(x.to('neuron')) * 2 + 1).cpu(), torch.sin(x) * 2 + 1)\n"
        "print(adaptive_eager.stats()['kernel_cache']['built'])\n"
    )
    env = dict(os.environ, NEURON_ADAPTIVE_EAGER="1", NEURON_ADAPTIVE_COMPILE="0")
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0"


def test_views_at_another_offset_in_each_launch_read_the_right_elements():
    """A view's offset is not part of an op's signature (x[i] looks the same for every
    i), so a built kernel must take it from each launch."""
    x = torch.randn(5, 7)
    for row in range(5):
        torch.testing.assert_close(((x.to("neuron") * 2)[row].exp() + 1).cpu(), (x * 2)[row].exp() + 1)
    assert adaptive_eager.stats()["kernel_cache"]["built"] == 1


def test_launching_and_building_leave_the_plan_unchanged(built_runs):
    """A cached KernelSpec is plan data: the device keeps a kernel's launch count and its
    built function in a table of its own (``fused_kernel.STATE``), so launching, building
    and running the built kernel change no field of the spec."""
    from adaptive_eager.statistics import FUSION

    def plan_fields():
        return {
            signature: [getattr(spec, name, None) for name in type(spec).__slots__ if name != "__weakref__"]
            for signature, spec in FUSION.caches["kernel_cache"]._data.items()
        }

    generator = torch.Generator().manual_seed(2)
    before = None
    for step in range(4):
        x, y = torch.randn(32, 16, generator=generator), torch.randn(32, 16, generator=generator)
        torch.testing.assert_close(chain(x.to("neuron"), y.to("neuron"), 0.5).cpu(), chain(x, y, 0.5))
        if before is None:
            before = plan_fields()  # after the first launch, before the kernel is built
    assert adaptive_eager.stats()["kernel_cache"]["built"] == 1 and len(built_runs) == 1 + 2
    assert plan_fields() == before
