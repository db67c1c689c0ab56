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


# Issue 35: the meta kernel accepts these dtypes, the CPU kernel has no implementation
# for them; the CPU's trial of the signature (shapes.trial_at_the_shapes) finds it.
def _interpolate_int(device):
    return F.interpolate(torch.ones(1, 1, 4, 4, dtype=torch.int32, device=device), scale_factor=2, mode="bilinear")


def _interpolate_int_antialiased(device):
    x = torch.ones(1, 1, 4, 4, dtype=torch.int32, device=device)
    return F.interpolate(x, scale_factor=2, mode="bicubic", antialias=True)


def _adaptive_max_pool_int(device):
    return F.adaptive_max_pool2d(torch.ones(1, 4, 4, dtype=torch.int32, device=device), 2)


def _max_pool_complex(device):  # a 3x3 window: the one-element trial is refused, the shaped one decides
    return F.max_pool2d(torch.ones(1, 1, 8, 8, dtype=torch.complex64, device=device), 3)


def _bool_matmul(device):
    return torch.ones(2, 2, dtype=torch.bool, device=device) @ torch.ones(2, 2, dtype=torch.bool, device=device)


CASES = [_mm_shapes, _linear_on_double, _long_matmul, _view, _cat, _broadcast, _float_index, _int32_target,
         _conv_dtypes, _interpolate_int, _interpolate_int_antialiased, _adaptive_max_pool_int, _max_pool_complex,
         _bool_matmul]


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


_DTYPE_CASES = [_interpolate_int, _interpolate_int_antialiased, _adaptive_max_pool_int, _max_pool_complex, _bool_matmul]


@pytest.mark.parametrize("case", _DTYPE_CASES, ids=lambda case: case.__name__.strip("_"))
def test_a_refused_signature_raises_at_the_call_from_the_cache(case, any_mode):
    """Issue 35: once the CPU refused a signature whatever the data (its trial's ones and
    zeros and the user's data alike), a call with it raises the CPU's error at once from
    the shape cache: no host run (no fallback op, no sync point), nothing deferred."""
    import adaptive_eager

    from adaptive_eager_device.ops import recorder

    recorder.SHAPE_CACHE.clear()
    cpu = _raised(case, "cpu")
    first = _raised(case, "neuron")  # a miss: the trial, then the host run decides
    assert type(first) is type(cpu) and str(first) == str(cpu)
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    with pytest.raises(type(cpu)) as caught:
        case("neuron")
    assert str(caught.value) == str(cpu)
    stats = adaptive_eager.stats()
    assert stats["fallback_ops"] == {} and stats["sync_points"] == {}, stats
    torch.neuron.synchronize()  # nothing was deferred


def test_a_refusal_the_data_decides_is_not_cached(any_mode):
    """A trial the CPU refuses for its values (a searchsorted ``sorter`` of ones into a
    one-element sequence) but accepts filled with zeros: the data decide. A bad call
    raises the CPU's error at the call (it ran on the host); the same signature with
    good data then computes, and later calls run on the device (no more fallbacks); a
    bad one there is a device error, deferred to the sync point, as an index is."""
    import adaptive_eager

    from adaptive_eager import NeuronRuntimeError
    from adaptive_eager_device.ops import recorder

    recorder.SHAPE_CACHE.clear()
    seq, values = torch.tensor([[3.0]]), torch.tensor([[1.0, 5.0]])
    bad, good = torch.tensor([[5]]), torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="sorter index out of range"):
        torch.searchsorted(seq.to("neuron"), values.to("neuron"), sorter=bad.to("neuron"))
    expected = torch.searchsorted(seq, values, sorter=good)
    assert torch.equal(torch.searchsorted(seq.to("neuron"), values.to("neuron"), sorter=good.to("neuron")).cpu(),
                       expected)
    adaptive_eager.reset_stats()
    assert torch.equal(torch.searchsorted(seq.to("neuron"), values.to("neuron"), sorter=good.to("neuron")).cpu(),
                       expected)
    assert adaptive_eager.stats()["fallback_ops"] == {}
    torch.searchsorted(seq.to("neuron"), values.to("neuron"), sorter=bad.to("neuron"))  # no error at the call
    with pytest.raises(NeuronRuntimeError):
        torch.neuron.synchronize()
