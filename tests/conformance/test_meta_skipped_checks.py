"""Host-side argument checks the meta kernels skip and the CPU kernels make (issue 19):
each must raise the CPU's error at the call on neuron, in strict and adaptive eager, also
after a valid call filled the shape cache, and never leave a deferred error behind.
The checks: ``index_put``'s value shape and dtype (``device/ops/index_checks.py``),
``complex``/``polar``/``logcumsumexp(out=)`` dtypes (``meta_overrides._dtypes_checked_on_cpu``),
the in-place activations' backward slopes (``op_table._CHECKED_ON_CPU``)."""
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager_device.core.counters import COUNTERS


def _setitem(index, values, size=(4,)):
    def call(device):
        a = torch.arange(float(size[0] * (size[1] if len(size) > 1 else 1)), device=device).view(size)
        a[index(a) if callable(index) else index] = values(device) if callable(values) else values
        return a

    return call


def _backward(activation):
    def call(device):
        a = torch.tensor([-1.0, 1.0], device=device, requires_grad=True)
        activation(a.clone()).backward(torch.ones(2, device=device))
        return a.grad

    return call


# (good call, bad call): the good one has the bad one's signature but for what the check reads
# (a float's value), or a neighbouring one; the bad one must raise as on the CPU.
CHECKS = {
    "index_put_ indices that do not broadcast": (
        _setitem(([0, 1], [0, 1]), 0.0, (5, 5)), _setitem(([0, 1], [0, 1, 2]), 0.0, (5, 5))),
    "index_put_ values that do not broadcast": (
        _setitem(([0, 1],), lambda d: torch.ones(2, device=d)), _setitem(([0, 1],), lambda d: torch.ones(3, device=d))),
    "index_put no indices, values of rank 1 into rank 0": (
        lambda d: torch.ones(2, device=d).index_put([torch.tensor([1], device=d)], torch.ones(1, device=d), True),
        lambda d: torch.ones([], device=d).index_put([], torch.ones(1, device=d), True)),
    "index_put_ values of another dtype": (
        _setitem((slice(None), [1]), lambda d: torch.ones(4, 1, device=d), (4, 2)),
        _setitem((slice(None), [1]), lambda d: torch.ones(4, 1, dtype=torch.int, device=d), (4, 2))),
    "index_put_ under a mask, too many values": (
        _setitem(lambda a: a > -1, lambda d: torch.ones(4, device=d)),
        _setitem(lambda a: a > -1, lambda d: torch.ones(3, device=d))),
    "index_put_ under a mask, no values": (
        _setitem(lambda a: a > -1, lambda d: torch.ones(1, device=d)),
        _setitem(lambda a: a > -1, lambda d: torch.ones(0, device=d))),
    "index of an empty dimension": (
        lambda d: torch.ones(10, 0, device=d)[[1, 2]], lambda d: torch.ones(10, 0, device=d)[:, [0, 1]]),
    "index_put_ into an empty dimension": (
        _setitem((slice(None), []), 0.0, (4, 0)), _setitem((slice(None), [0]), 0.0, (4, 0))),
    "masked_scatter_ with a mask that broadcasts beyond its target": (
        lambda d: torch.zeros(2, 3, device=d).masked_scatter_(torch.tensor([True, False, True], device=d),
                                                             torch.arange(6.0, device=d)),
        lambda d: torch.zeros(1, device=d).masked_scatter_(torch.ones(2, 1, 2, 1, dtype=torch.bool, device=d),
                                                          torch.ones(4, device=d))),
    "complex of two dtypes": (
        lambda d: torch.complex(torch.ones(2, device=d), torch.ones(2, device=d)),
        lambda d: torch.complex(torch.ones(2, device=d), torch.ones(2, device=d, dtype=torch.double))),
    "polar of two dtypes": (
        lambda d: torch.polar(torch.ones(2, device=d), torch.ones(2, device=d)),
        lambda d: torch.polar(torch.ones(2, device=d), torch.ones(2, device=d, dtype=torch.double))),
    "logcumsumexp out= of another dtype": (
        lambda d: torch.logcumsumexp(torch.ones(5, 2, device=d), -1, out=torch.empty(5, 2, device=d)),
        lambda d: torch.logcumsumexp(torch.ones(5, 2, device=d, dtype=torch.double), -1,
                                     out=torch.empty(5, 2, device=d))),
    "elu_ backward, negative alpha": (
        _backward(lambda t: F.elu_(t, alpha=2.0)), _backward(lambda t: F.elu_(t, alpha=-2.0))),
    "leaky_relu_ backward, negative slope": (
        _backward(lambda t: F.leaky_relu_(t, 2.0)), _backward(lambda t: F.leaky_relu_(t, -2.0))),
    "rrelu_ backward, negative lower bound": (
        _backward(lambda t: F.rrelu_(t, 0.1, 1.0)), _backward(lambda t: F.rrelu_(t, -5.0, 1.0))),
}


def _outcome(call, device):
    try:
        return call(device)
    except Exception as error:  # noqa: BLE001
        return error


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_checks_the_meta_kernel_skips_raise_the_cpus_error_at_the_call(name):
    good, bad = CHECKS[name]
    expected = _outcome(bad, "cpu")
    assert isinstance(expected, Exception)
    torch.manual_seed(0)
    on_cpu = good("cpu")
    torch.manual_seed(0)
    on_device = good("neuron")  # fills the shape cache
    assert torch.equal(on_device.cpu(), on_cpu)
    with pytest.raises(type(expected)) as raised:
        bad("neuron")  # at the call, not at the next sync point
    assert str(raised.value) == str(expected)
    adaptive_eager.synchronize()  # nothing left pending


@pytest.mark.usefixtures("any_mode")
def test_valid_index_puts_stay_on_the_device():
    """The checks accept valid calls without a host run: long indices with broadcasting
    values, a mask with one value (its count is not needed)."""
    calls = [
        _setitem(([0, 2],), lambda d: torch.tensor([7.0, 8.0], device=d)),
        _setitem(([[0], [1]], [0, 2]), lambda d: torch.ones(1, device=d), (3, 3)),
        _setitem(lambda a: a > 1, 0.0),
        _setitem(lambda a: a > 1, lambda d: torch.tensor([5.0], device=d)),
    ]
    expected = [call("cpu") for call in calls]
    adaptive_eager.synchronize()
    before = sum(COUNTERS.sync_points.values())
    results = [call("neuron") for call in calls]
    assert sum(COUNTERS.sync_points.values()) == before
    for result, cpu in zip(results, expected):
        assert torch.equal(result.cpu(), cpu)


@pytest.mark.usefixtures("any_mode")
def test_a_mask_with_several_values_runs_on_the_host_with_the_cpus_result():
    """Values of several elements under a mask need the count of True: a sync point,
    then the CPU's result (here a valid call)."""
    call = _setitem(lambda a: a > 1, lambda d: torch.tensor([5.0, 6.0], device=d))
    adaptive_eager.reset_stats()
    assert torch.equal(call("neuron").cpu(), call("cpu"))
    stats = adaptive_eager.stats()  # a data-dependent op, as on CUDA: not the CPU fallback
    assert stats["fallback_ops"] == {} and stats["sync_points"].get("data_dependent: aten::index_put_") == 1


@pytest.mark.usefixtures("any_mode")
def test_a_host_tensor_indexed_with_device_indices_raises_atens_error():
    """ATen's meta check (indices on the CPU or on the indexed tensor's device), which CUDA
    raises and meta tensors cannot: a host tensor with device indices is refused, reading
    and writing; device tensors take host indices, as on CUDA."""
    x = torch.arange(24.0).view(2, 3, 4)
    index = torch.tensor([0, 2, 1])
    for call in (lambda i: x[:, i], lambda i: x[:, index, None, i.clamp(max=1)], lambda i: x.index_put_((i,), torch.ones(1))):
        with pytest.raises(RuntimeError, match=r"^indices should be either on cpu or on the same device as the indexed tensor \(cpu\)$"):
            call(index.to("neuron"))
    device = x.to("neuron")
    assert torch.equal(device[:, index].cpu(), x[:, index])
    device[:, index] = 5.0
    x[:, index] = 5.0
    assert torch.equal(device.cpu(), x)


@pytest.mark.usefixtures("any_mode")
def test_deterministic_mode_refuses_put_at_the_call_also_after_a_cache_hit():
    """``put_`` has no deterministic CPU kernel: under ``use_deterministic_algorithms`` the
    CPU refuses it before it reads data. Turning the mode on empties the shape cache, so the
    check runs for a signature the cache already held."""
    def put(device):
        return torch.zeros(10, device=device).put_(torch.tensor([0, 1], device=device), torch.ones(2, device=device))

    assert torch.equal(put("neuron").cpu(), put("cpu"))  # fills the cache
    torch.use_deterministic_algorithms(True)
    try:
        expected = _outcome(put, "cpu")
        assert isinstance(expected, RuntimeError)
        with pytest.raises(RuntimeError) as raised:
            put("neuron")
        assert str(raised.value) == str(expected)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(put("neuron").cpu(), put("cpu"))
    adaptive_eager.synchronize()
