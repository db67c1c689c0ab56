"""Failures PyTorch's own device-generic suites found on `neuron` (issue 19), each as a
small repro checked against the CPU, in strict and adaptive eager. The upstream files are
not needed: each test is the failing call itself."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from conftest import assert_same

aten = torch.ops.aten


def _cpu_error(call, device="cpu"):
    """The error ``call(device)`` raises on the CPU (None if it succeeds)."""
    try:
        call(device)
    except Exception as error:  # noqa: BLE001
        return error
    return None


# -- 1. argument checks raise at the call, also when the shape cache hits ------------------
# (good call, bad call): the good one fills the shape cache with the bad one's signature
# but for a float's value (or with a signature whose meta kernel skips the check).
ARGUMENT_CHECKS = {
    "normal_ std < 0": (lambda t: t.normal_(0.0, 1.0), lambda t: t.normal_(0.0, -1.0)),
    "uniform_ from > to": (lambda t: t.uniform_(0.0, 1.0), lambda t: t.uniform_(2.0, 1.0)),
    "random_ from >= to": (lambda t: t.random_(0, 5), lambda t: t.random_(5, 2)),
    "exponential_ lambda < 0": (lambda t: t.exponential_(1.0), lambda t: t.exponential_(-1.0)),
    "bernoulli_ p > 1": (lambda t: t.bernoulli_(0.5), lambda t: t.bernoulli_(1.5)),
    "geometric_ p > 1": (lambda t: t.geometric_(0.5), lambda t: t.geometric_(1.5)),
    "cauchy_ sigma < 0": (lambda t: t.cauchy_(0.0, 1.0), lambda t: t.cauchy_(0.0, -1.0)),
    "native_dropout p < 0": (lambda t: aten.native_dropout(t, 0.5, True), lambda t: aten.native_dropout(t, -0.5, True)),
    "softmax dim": (lambda t: aten._softmax(t, 0, False), lambda t: aten._softmax(t, 3, False)),
    "celu alpha 0": (lambda t: F.celu(t, 1.0), lambda t: F.celu(t, 0.0)),
    "smooth_l1 beta < 0": (lambda t: F.smooth_l1_loss(t, t, beta=1.0), lambda t: F.smooth_l1_loss(t, t, beta=-1.0)),
    "integer add_ float alpha": (lambda t: t.long().add_(t.long(), alpha=2), lambda t: t.long().add_(t.long(), alpha=1.5)),
    "bool mul_ float": (lambda t: (t > 0).mul_(True), lambda t: (t > 0).mul_(1.5)),
    "index_fill_ complex into real": (lambda t: t.index_fill_(0, _index(t), 2.0),
                                      lambda t: t.index_fill_(0, _index(t), 1 + 1j)),
}


RANDOM_FACTORY_CHECKS = {
    "randint complex": lambda d: torch.randint(6, (3,), device=d, dtype=torch.complex64),
    "randint complex, empty": lambda d: torch.randint(6, (0,), device=d, dtype=torch.complex64),
    "randperm overflows uint8": lambda d: torch.randperm(257, out=torch.empty(0, dtype=torch.uint8, device=d)),
}


@pytest.mark.parametrize("name", sorted(RANDOM_FACTORY_CHECKS))
def test_random_factory_argument_errors_raise_at_the_call(name):
    call = RANDOM_FACTORY_CHECKS[name]
    expected = _cpu_error(call)
    assert expected is not None
    with pytest.raises(type(expected)) as raised:
        call("neuron")
    assert str(raised.value) == str(expected)


def _index(t):
    return torch.tensor([3], device=t.device)


def test_ops_checked_on_cpu_still_run_on_the_device():
    """The CPU trial of argument checks (``shapes.check_on_cpu``) must accept valid calls:
    an index into the one-element trial tensors is 0, in range."""
    from adaptive_eager_device.core.counters import COUNTERS

    before = sum(COUNTERS.fallback_ops.values())
    x = torch.zeros(3, 3)
    d = x.to("neuron")
    for dim in (0, 1):
        x.index_fill_(dim, torch.tensor([2]), 5.0)
        d.index_fill_(dim, torch.tensor([2], device="neuron"), 5.0)
    assert torch.equal(d.cpu(), x)
    assert sum(COUNTERS.fallback_ops.values()) == before


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("name", sorted(ARGUMENT_CHECKS))
def test_argument_errors_raise_at_the_call(name):
    good, bad = ARGUMENT_CHECKS[name]
    expected = _cpu_error(lambda device: bad(torch.ones(4, device=device)))
    assert expected is not None
    t = torch.ones(4, device="neuron")
    good(t)
    with pytest.raises(type(expected)) as raised:
        bad(t)  # not deferred to the sync point: at the call, as on the CPU (and CUDA)
    assert str(raised.value) == str(expected)
    adaptive_eager.synchronize()  # nothing left pending either


# -- 2 and 3. errors inside backward, storages: a clean error or the CPU's result, never an
# abort or a segfault. Run in a child process, so a crash fails the test, not pytest.
_CHILD = textwrap.dedent(r"""
    import io, json, sys
    import torch, torch.nn.functional as F
    import adaptive_eager

    def pool(dev):
        x = torch.ones(1, 2, 4, 4, device=dev, requires_grad=True)
        F.adaptive_avg_pool2d(x, 0).sum().backward()
        return x.grad

    def gather_sparse_grad(dev):
        x = torch.arange(12., device=dev).view(3, 4).requires_grad_()
        index = torch.tensor([[0, 1], [2, 3], [1, 1]], device=dev)
        torch.gather(x, 1, index, sparse_grad=True).sum().backward()
        return x.grad.to_dense()

    def _bag(dev, **options):
        torch.manual_seed(0)
        return torch.nn.EmbeddingBag(10, 3, **options).to(dev)

    def bag_per_sample_weights(dev):
        bag = _bag(dev, mode="sum")
        weights = torch.tensor([0.5, 1.0, 2.0, 0.25], device=dev, requires_grad=True)
        indices, offsets = torch.tensor([1, 2, 4, 5], device=dev), torch.tensor([0, 2], device=dev)
        bag(indices, offsets, per_sample_weights=weights).sum().backward()
        return torch.cat([bag.weight.grad.flatten(), weights.grad])

    def bag_padding_idx(dev):
        bag = _bag(dev, mode="mean", padding_idx=1)
        bag(torch.tensor([1, 2, 4, 5], device=dev), torch.tensor([0, 2], device=dev)).sum().backward()
        return bag.weight.grad

    def bag_sparse(dev):
        bag = _bag(dev, mode="sum", sparse=True)
        bag(torch.tensor([1, 2, 4, 5], device=dev), torch.tensor([0, 2], device=dev)).sum().backward()
        return bag.weight.grad.to_dense()

    def untyped_storage(dev):
        storage = torch.UntypedStorage(100, device=dev)
        return torch.tensor([storage.nbytes(), storage.device.type == dev])

    def storage_clone(dev):
        t = torch.arange(6., device=dev)
        clone = t.untyped_storage().clone()
        return torch.empty(0, device=dev).set_(clone).view(torch.float32)

    def load_map_location(dev):
        buffer = io.BytesIO()
        torch.save({"t": torch.arange(6.).view(2, 3)[:, 1]}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=dev)["t"]
        assert loaded.device.type == dev
        return loaded

    out = {}
    for case in sys.argv[1:]:
        outcome = {}
        for dev in ("cpu", "neuron"):
            try:
                value = globals()[case](dev)
                if dev == "neuron":
                    adaptive_eager.synchronize()
                outcome[dev] = ["ok", value.cpu().tolist()]
            except Exception as error:
                outcome[dev] = ["error", type(error).__name__, str(error).splitlines()[0]]
        out[case] = outcome
    print(json.dumps(out))
""")
CRASH_CASES = ["pool", "gather_sparse_grad", "bag_per_sample_weights", "bag_padding_idx", "bag_sparse",
               "untyped_storage", "storage_clone", "load_map_location"]
# Sparse gradients ("gather_sparse_grad", "bag_sparse") are sparse COO tensors on the
# device (device/ops/sparse.py): their values equal the CPU's like the others'.


@pytest.fixture(scope="module", params=["strict", "adaptive"])
def child_outcomes(request):
    env = dict(os.environ, NEURON_ADAPTIVE_EAGER="1" if request.param == "adaptive" else "0")
    done = subprocess.run([sys.executable, "-c", _CHILD, *CRASH_CASES], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, f"child crashed ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CRASH_CASES)
def test_no_abort_or_segfault(child_outcomes, case):
    cpu, neuron = child_outcomes[case]["cpu"], child_outcomes[case]["neuron"]
    if cpu[0] == "error":
        assert neuron == cpu
    else:
        assert neuron[0] == "ok", neuron
        torch.testing.assert_close(torch.tensor(neuron[1]), torch.tensor(cpu[1]))


# -- 4. arange/linspace/logspace into a non-contiguous view write its base --------------------
def _arange(start, end, steps, out):
    return torch.arange(start, end, (end - start) / steps, out=out)


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("fn", [torch.linspace, torch.logspace, _arange], ids=["linspace", "logspace", "arange"])
def test_space_out_into_a_view_writes_the_base(fn):
    def run(device):
        x = torch.zeros(2, 3, device=device)
        y = fn(0, 3, 4, out=x.narrow(1, 1, 2))  # 4 values into a (2, 2) view: no resize
        z = torch.zeros(4, 4, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
            fn(0, 1, 4, out=z[::2, 2])  # resized, over the same storage from its offset
        return x, y, z

    assert_same(list(run("neuron")), list(run("cpu")))


# -- 5. shape and dtype inference ----------------------------------------------------------
@pytest.mark.usefixtures("any_mode")
def test_prims_signbit_is_bool():
    x = torch.tensor([-1.0, 2.0, -0.0, 3.0])
    assert_same(torch.ops.prims.signbit(x.to("neuron")), torch.ops.prims.signbit(x))


@pytest.mark.usefixtures("any_mode")
def test_multi_margin_loss_on_one_sample():
    x, target = torch.tensor([0.1, 0.7, 0.2]), torch.tensor(1)
    for reduction in ("none", "mean"):
        expected = F.multi_margin_loss(x, target, reduction=reduction)
        assert_same(F.multi_margin_loss(x.to("neuron"), target.to("neuron"), reduction=reduction), expected)


@pytest.mark.usefixtures("any_mode")
def test_shape_cache_keys_the_default_dtype():
    a = torch.tensor([4, 6])
    d = a.to("neuron")
    assert_same(torch.div(d, d), torch.div(a, a))  # float32, cached
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        expected = torch.div(a, a)
        assert expected.dtype == torch.float64
        assert_same(torch.div(d, d), expected)
        assert_same(torch.arange(0.0, 3.0, device="neuron"), torch.arange(0.0, 3.0))
    finally:
        torch.set_default_dtype(saved)


# -- 6. torch.tensor of 0-dim neuron tensors ---------------------------------------------------
@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_tensor_from_zero_dim_device_tensors(dtype):
    a, b = torch.tensor([1, 0, 1]).to(dtype), torch.tensor([0, 1, 1]).to(dtype)
    na, nb = a.to("neuron"), b.to("neuron")
    result = torch.tensor([na[0], nb[0]])
    assert result.device.type == "cpu"  # as the CPU: a host tensor of the values
    torch.testing.assert_close(result, torch.tensor([a[0], b[0]]))
    torch.testing.assert_close(torch.tensor([[na[0]], [nb[1]]], dtype=torch.float32),
                               torch.tensor([[a[0]], [b[1]]], dtype=torch.float32))


# -- 7. CPU tensors PyTorch accepts beside device ones --------------------------------------
@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("index", [torch.tensor([0, 2]), torch.tensor(1)], ids=["1-d", "0-d"])
def test_index_fill_with_a_cpu_index(index):
    x = torch.arange(12.0).view(3, 4)
    assert_same(x.to("neuron").index_fill(1, index, -1.0), x.index_fill(1, index, -1.0))
    assert_same(x.to("neuron").index_fill_(1, index, torch.tensor(2.0)), x.clone().index_fill_(1, index, torch.tensor(2.0)))


@pytest.mark.usefixtures("any_mode")
def test_pack_padded_sequence_with_cpu_lengths():
    from torch.nn.utils.rnn import pack_padded_sequence

    x, lengths = torch.randn(5, 2, 3), torch.tensor([5, 3])
    packed, expected = pack_padded_sequence(x.to("neuron"), lengths), pack_padded_sequence(x, lengths)
    assert_same(packed.data, expected.data)
    assert torch.equal(packed.batch_sizes, expected.batch_sizes)


_LIKE_OPS = {
    "full_like": lambda x, **kw: torch.full_like(x, 2.5, **kw),
    "ones_like": lambda x, **kw: torch.ones_like(x, **kw),
    "zeros_like": lambda x, **kw: torch.zeros_like(x, **kw),
    "new_full": lambda x, **kw: x.new_full((2, 3), -1.5, **kw),
    "new_ones": lambda x, **kw: x.new_ones((2, 3), **kw),
    "new_zeros": lambda x, **kw: x.new_zeros((2, 3), **kw),
    "_refs.to": lambda x, **kw: torch._refs.to(x, kw["device"], kw["dtype"]),
}


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("name", sorted(_LIKE_OPS))
def test_creation_from_a_cpu_tensor_onto_the_device(name):
    # OpInfo's compare-with-CPU test: the CPU sample keeps device="neuron" in its kwargs
    op, x = _LIKE_OPS[name], torch.randn(5)
    result = op(x, dtype=torch.float32, device="neuron")
    assert result.device.type == "neuron"
    torch.testing.assert_close(result.cpu(), op(x, dtype=torch.float32, device="cpu"))


@pytest.mark.usefixtures("any_mode")
def test_refs_reshape_and_as_strided():
    x = torch.arange(10.0)
    d = x.to("neuron")
    assert_same(torch._refs.reshape(d, (2, 5)), torch._refs.reshape(x, (2, 5)))
    assert_same(torch._refs.as_strided(d, (2, 2), (1, 2), 3), torch._refs.as_strided(x, (2, 2), (1, 2), 3))


# -- 8. memory formats ------------------------------------------------------------------------
@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("swap", [False, True])
def test_module_to_channels_last_after_a_forward(swap):
    saved = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        results = {}
        for device in ("cpu", "neuron"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).to(device)
            model(torch.randn(2, 3, 8, 8).to(device)).sum().backward()
            model.to(memory_format=torch.channels_last)
            weight = model[0].weight
            results[device] = (weight.stride(), weight.grad.stride(), model[0](torch.ones(1, 3, 8, 8).to(device)))
        assert results["neuron"][:2] == results["cpu"][:2]
        assert_same(results["neuron"][2], results["cpu"][2].detach(), atol=1e-5, rtol=1e-4)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(saved)


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("pool", ["max_pool3d", "avg_pool3d", "max_pool3d_indices"])
def test_pool3d_keeps_channels_last_3d(pool):
    def run(device):
        x = torch.randn(2, 3, 4, 6, 6, generator=torch.Generator().manual_seed(0)).to(device)
        x = x.to(memory_format=torch.channels_last_3d).requires_grad_()
        if pool == "max_pool3d_indices":
            y, indices = F.max_pool3d(x, 2, return_indices=True)
        else:
            y, indices = getattr(F, pool)(x, 2), None
        y.sum().backward()
        return y, indices, x.grad

    (y, i, g), (cy, ci, cg) = run("neuron"), run("cpu")
    assert y.stride() == cy.stride() and g.stride() == cg.stride()
    assert y.is_contiguous(memory_format=torch.channels_last_3d) == cy.is_contiguous(memory_format=torch.channels_last_3d)
    assert_same(y, cy.detach())
    assert_same(g, cg)
    if i is not None:
        assert i.stride() == ci.stride()
        assert_same(i, ci)


@pytest.mark.parametrize("make", [lambda: torch.nn.LazyLinear(3), lambda: torch.nn.LazyConv2d(3, 2)], ids=["LazyLinear", "LazyConv2d"])
def test_lazy_module_moved_to_neuron_before_its_first_forward(make, any_mode):
    """`.to("neuron")` of an UninitializedParameter (whose .shape raises) is legal, as on
    CUDA: the module then materializes on the device at its first forward, as the CPU's."""
    x = torch.randn(2, 2, 5, 5) if "Conv" in type(make()).__name__ else torch.randn(2, 4)
    torch.manual_seed(0)
    cpu = make()
    expected = cpu(x)
    torch.manual_seed(0)
    moved = make().to("neuron")
    out = moved(x.to("neuron"))
    assert all(p.device.type == "neuron" for p in moved.parameters())
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("op", ["masked_select", "nonzero"])
def test_data_dependent_op_resizes_its_out_tensor(op, any_mode):
    """`out=` of an op whose output size only the data decides is resized, as on the CPU
    (the device tensor once kept its old shape while the host result had the new one)."""
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.bool)
    src = torch.arange(10.0)
    results = []
    for device in ("cpu", "neuron"):
        out = torch.empty(0, dtype=torch.long if op == "nonzero" else torch.float32, device=device)
        if op == "nonzero":
            torch.nonzero(mask.to(device), out=out)
        else:
            torch.masked_select(src.to(device), mask.to(device), out=out)
        results.append(out)
    cpu, neuron = results
    assert neuron.shape == cpu.shape and neuron.stride() == cpu.stride()
    torch.testing.assert_close(neuron.cpu(), cpu)


@pytest.mark.parametrize("name", ["fmod_", "remainder_", "atan2_", "eq_", "pow_"])
def test_in_place_op_never_resizes_its_input(name, any_mode):
    """`small.op_(large)` raises the CPU's error at the call (these ops' meta kernels,
    decompositions with out= handling, once resized `small` to the broadcast shape,
    silently; structured ops such as add_ always raised)."""
    small, large = torch.randn(1, 3), torch.randn(4, 3)
    with pytest.raises(RuntimeError) as expected:
        getattr(small.clone(), name)(large)
    device_small = small.to("neuron")
    with pytest.raises(RuntimeError) as raised:
        getattr(device_small, name)(large.to("neuron"))
    assert str(raised.value) == str(expected.value)
    assert device_small.shape == (1, 3)
    torch.testing.assert_close(device_small.cpu(), small)


# -- memory overlap: refused at the call, as the CPU refuses it (device/ops/overlap.py) --------

OVERLAPPING_CALLS = {
    "index_add_ of itself": lambda d: (lambda x: x.index_add_(0, torch.tensor([1, 0, 3, 2], device=d), x))(
        torch.arange(4.0, device=d)),
    "add out= a shifted view": lambda d: (lambda x: torch.add(x[:3], 1, out=x[1:]))(torch.arange(4.0, device=d)),
    "scatter_ of itself": lambda d: (lambda x: x.scatter_(0, torch.tensor([1, 0], device=d), x))(
        torch.arange(2.0, device=d)),
    "index_copy_ of a view of itself": lambda d: (lambda x: x[1:].index_copy_(0, torch.tensor([0, 1], device=d), x[:2]))(
        torch.arange(3.0, device=d)),
}


@pytest.mark.parametrize("name", sorted(OVERLAPPING_CALLS))
def test_memory_overlap_raises_the_cpus_error_at_the_call(name):
    call = OVERLAPPING_CALLS[name]
    with pytest.raises(RuntimeError, match="refer to a single memory location") as on_cpu:
        call("cpu")
    with pytest.raises(RuntimeError, match="refer to a single memory location") as on_device:
        call("neuron")  # at the call, not at the next sync point
    assert str(on_device.value).splitlines()[0] == str(on_cpu.value).splitlines()[0]
    torch.neuron.synchronize()  # nothing deferred either


def test_aliasing_the_cpu_accepts_runs_on_the_device_and_is_tried_once():
    from adaptive_eager_device.ops import overlap
    from adaptive_eager_device.core.counters import COUNTERS

    tried = []
    trial = overlap._trial_refused

    def counting(entry, args, kwargs):
        tried.append(entry.name)
        return trial(entry, args, kwargs)

    overlap._trial_refused = counting
    try:
        x = torch.arange(4.0)
        d = x.to("neuron")
        fallbacks = sum(COUNTERS.fallback_ops.values())
        for _ in range(3):
            torch.add(d, 1, out=d)  # full overlap: fine for a pointwise op
            d.add_(d)
            torch.add(x, 1, out=x)
            x.add_(x)
        assert torch.equal(d.cpu(), x)
        assert sum(COUNTERS.fallback_ops.values()) == fallbacks  # ran on the device
        assert sorted(tried) == ["aten::add", "aten::add_"]  # one trial per aliasing, then remembered
    finally:
        overlap._trial_refused = trial


def test_inputs_sharing_a_storage_are_not_tried(monkeypatch):
    """Only a *written* storage shared with another argument can overlap: AdamW's
    ``_foreach_addcmul_(v, g, g)`` reads one gradient twice every step, and must not pay
    the overlap check (``overlap.writes_shared``) on the per-op path."""
    from adaptive_eager_device.ops import overlap

    checked = []
    monkeypatch.setattr(overlap, "refused", lambda *args: checked.append(args[0].name) or False)
    v, g = torch.rand(8), torch.randn(8)
    dv, dg = v.to("neuron"), g.to("neuron")
    for _ in range(2):
        v.addcmul_(g, g, value=0.5)
        dv.addcmul_(dg, dg, value=0.5)
        torch._foreach_addcmul_([v], [g], [g], value=0.5)
        torch._foreach_addcmul_([dv], [dg], [dg], value=0.5)
    torch.testing.assert_close(dv.cpu(), v)
    assert checked == []
    dv.add_(dv)  # a written storage read again: checked
    assert checked == ["aten::add_"]


# -- the CPU's warnings for an op's arguments, at each call (the kernel runs on the worker) --
WARNING_CALLS = {
    "random_ from beyond float32's integers": lambda d: torch.empty(3, device=d).random_(2**25, 2**25 + 10),
    "index_put_ with a uint8 mask": lambda d: torch.zeros(4, 4, device=d).index_put_(
        (torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device=d),), torch.ones(4, device=d)),
}


def _warnings_of(call, device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second call hits the shape cache
            result = call(device)
        if device == "neuron":
            result.cpu()
    return [(str(w.message).split(" (Triggered internally")[0], w.category) for w in caught], result


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("name", sorted(WARNING_CALLS))
def test_the_cpus_warnings_for_the_arguments_reach_the_user_at_each_call(name):
    neuron, neuron_result = _warnings_of(WARNING_CALLS[name], "neuron")
    cpu, cpu_result = _warnings_of(WARNING_CALLS[name], "cpu")
    assert len(cpu) >= 2 and neuron == cpu
    if "random" not in name:
        assert_same(neuron_result, cpu_result)


# -- a pointwise op's out= tensor resized takes the strides the CPU gives it ----------------
@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("make", [lambda d: torch.randn(2, 3, 4, device=d).permute(0, 2, 1),
                                  lambda d: torch.randn(1, 1, 4, 12, device=d)[:, :, :, ::2].permute(2, 0, 3, 1)],
                         ids=["permuted", "sliced with size-1 dims"])
@pytest.mark.parametrize("op", [torch.add, torch.eq, torch.exp])
def test_pointwise_out_resized_from_empty_keeps_the_cpus_strides(make, op):
    torch.manual_seed(0)
    x = make("cpu")
    args = (x,) if op is torch.exp else (x, x)
    expected = op(*args, out=torch.empty(0, dtype=op(*args).dtype))
    neuron_args = tuple(a.to("neuron") if a is not x else make("neuron").copy_(x.to("neuron")) for a in args)
    result = op(*neuron_args, out=torch.empty(0, dtype=expected.dtype, device="neuron"))
    assert result.stride() == expected.stride()
    assert_same(result, expected)


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
def test_multilabel_margin_loss_of_one_sample_unreduced(shape):
    torch.manual_seed(0)
    x, target = torch.randn(shape), torch.zeros(shape, dtype=torch.long)
    expected = F.multilabel_margin_loss(x, target, reduction="none")
    result = F.multilabel_margin_loss(x.to("neuron"), target.to("neuron"), reduction="none")
    assert result.shape == expected.shape
    assert_same(result, expected)


# the range factories resize an out= tensor of another count with resize_, quietly; arange
# warns its own "The out tensor will be resized"
@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("call", [lambda o: torch.arange(-1, 1, 2.0 / 49, dtype=torch.float32, out=o),
                                  lambda o: torch.linspace(0, 1, 6, out=o)], ids=["arange", "linspace"])
def test_range_factories_into_an_out_tensor_of_another_count_warn_as_the_cpu(call):
    def run(device):
        return _warnings_of(lambda d: call(torch.zeros(1, 49, device=d)), device)

    (neuron, neuron_result), (cpu, cpu_result) = run("neuron"), run("cpu")
    assert neuron == cpu
    assert_same(neuron_result, cpu_result)
