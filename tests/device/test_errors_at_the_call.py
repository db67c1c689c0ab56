"""Shape and dtype errors on ``neuron`` read like the CPU's (issue 21): the CPU's
exception type and message, raised from the user's line, with the CPU's traceback (the
same frames, the same length) and no chained internal error (the meta kernel's
rejection, the dispatcher's frames). ``NEURON_FULL_STACK=1`` keeps the device's frames
and the chain, for debugging the device."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager_device

from adaptive_eager_device.core.config import CONFIG


def _mm_shapes(device):
    return torch.ones(2, 3, device=device) @ torch.ones(2, 3, device=device)


def _linear_on_double(device):  # the model is float32, the input float64
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).to(device)(torch.ones(2, 3, dtype=torch.float64, device=device))


def _long_matmul(device):
    return torch.ones(2, 2, dtype=torch.long, device=device) @ torch.ones(2, 2, device=device)


def _view(device):
    return torch.ones(2, 3, device=device).view(7)


def _cat(device):
    return torch.cat([torch.ones(2, 3, device=device), torch.ones(2, 4, device=device)])


def _broadcast(device):
    return torch.ones(2, device=device) + torch.ones(3, device=device)


def _float_index(device):
    return torch.ones(3, device=device).index_select(0, torch.zeros(2, device=device))


def _int32_target(device):
    return F.cross_entropy(torch.ones(2, 3, device=device), torch.zeros(2, dtype=torch.int32, device=device))


def _conv_dtypes(device):
    return F.conv2d(torch.ones(1, 1, 3, 3, dtype=torch.float64, device=device), torch.ones(1, 1, 2, 2, device=device))


CASES = [_mm_shapes, _linear_on_double, _long_matmul, _view, _cat, _broadcast, _float_index, _int32_target,
         _conv_dtypes]


def _raised(case, device):
    try:
        case(device)
        if device == "neuron":
            torch.neuron.synchronize()
    except Exception as error:  # noqa: BLE001 - what the user would see
        return error
    raise AssertionError(f"{case.__name__} did not raise on {device}")


def _frames(error):
    return [(frame.filename, frame.name) for frame in traceback.extract_tb(error.__traceback__)]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.strip("_"))
def test_an_error_on_neuron_reads_like_the_cpu_error(case, any_mode):
    cpu, neuron = _raised(case, "cpu"), _raised(case, "neuron")
    assert type(neuron) is type(cpu)
    assert str(neuron) == str(cpu)
    # Raised from the user's line, through the same frames as on the CPU (this test's
    # frame, the case's line, any torch.nn frames): none of the device's.
    assert _frames(neuron) == _frames(cpu)
    shown_cpu = "".join(traceback.format_exception(cpu))
    shown_neuron = "".join(traceback.format_exception(neuron))
    assert len(shown_neuron.splitlines()) == len(shown_cpu.splitlines()), shown_neuron
    assert "meta" not in shown_neuron.lower() and "During handling" not in shown_neuron
    device_package = os.path.dirname(adaptive_eager_device.__file__) + os.sep
    assert "adaptive_eager_device" not in shown_neuron and device_package not in shown_neuron


def test_full_stack_keeps_the_device_frames_and_the_chain(monkeypatch):
    monkeypatch.setattr(CONFIG, "full_stack", True)
    cpu, neuron = _raised(_mm_shapes, "cpu"), _raised(_mm_shapes, "neuron")
    assert str(neuron) == str(cpu)
    shown = "".join(traceback.format_exception(neuron))
    assert "During handling of the above exception" in shown
    assert "meta_mm" in shown  # the meta kernel's rejection, chained
    assert len(_frames(neuron)) > len(_frames(cpu)) + 3


def test_a_bug_of_the_device_keeps_its_traceback(monkeypatch):
    """Only the user's errors lose the device's frames: an error the device did not mark
    as the user's (here, a failing shape inference) keeps them all."""
    from adaptive_eager_device.ops import recorder

    def broken(*args, **kwargs):
        raise KeyError("a bug in shape inference")

    monkeypatch.setattr(recorder, "infer", broken)
    recorder.SHAPE_CACHE.clear()
    with pytest.raises(KeyError) as caught:
        torch.ones(2, 3, device="neuron") * 3.5
    files = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert any(name.endswith("recorder.py") for name in files), files


def test_the_dtype_check_is_not_paid_by_matching_dtypes():
    """Operands of one dtype keep the meta kernel (no CPU probe, no fallback), and a mix
    the CPU accepts (bfloat16 layer norm with float32 weights) computes what the CPU does."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    assert torch.equal((x.to("neuron") @ w.to("neuron")).cpu(), x @ w)
    import adaptive_eager

    assert adaptive_eager.stats()["fallback_ops"] == {}
    h = torch.randn(2, 8).bfloat16()
    weight, bias = torch.randn(8), torch.randn(8)
    expected = torch.native_layer_norm(h, (8,), weight, bias, 1e-5)
    got = torch.native_layer_norm(h.to("neuron"), (8,), weight.to("neuron"), bias.to("neuron"), 1e-5)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)
