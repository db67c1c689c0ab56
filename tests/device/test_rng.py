"""RNG streams: a seeded program draws on ``neuron`` exactly what it draws on the CPU.

The contract is CUDA's: ``neuron`` has a generator of its own, seeded by
``torch.manual_seed``, and random ops on neuron tensors draw from it in program order.
So the same program run with ``device="cpu"`` and with ``device="neuron"`` draws the
same numbers bit for bit, whatever random ops it calls, in any order, in strict and in
adaptive eager (where random ops sit inside fused kernels).

``RANDOM_OPS`` covers every random op in torch reachable from Python; the differential
test draws random sequences of them, mixed with pointwise ops that fuse around them.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaptive_eager

pytestmark = pytest.mark.usefixtures("any_mode")


def _probabilities(device):
    return torch.linspace(0.05, 0.95, 12, device=device)


# name -> f(device, x, generator): x is a (3, 4) float tensor on the device with values
# in (0, 1); each returns the tensors it drew (or made from draws).
RANDOM_OPS = {
    "rand": lambda d, x, g: torch.rand(3, 4, device=d, generator=g),
    "randn": lambda d, x, g: torch.randn(17, device=d, generator=g),
    "rand_like": lambda d, x, g: torch.rand_like(x),
    "randn_like": lambda d, x, g: torch.randn_like(x),
    "randint": lambda d, x, g: torch.randint(0, 10, (6,), device=d, generator=g),
    "randint_high": lambda d, x, g: torch.randint(7, (2, 3), device=d, generator=g),
    "randint_like": lambda d, x, g: torch.randint_like(x, 5),
    "randperm": lambda d, x, g: torch.randperm(9, device=d, generator=g),
    "bernoulli_p_tensor": lambda d, x, g: torch.bernoulli(x, generator=g),
    "bernoulli_scalar": lambda d, x, g: torch.bernoulli(x, 0.3, generator=g),
    "bernoulli_inplace_float": lambda d, x, g: torch.empty_like(x).bernoulli_(0.6, generator=g),
    "bernoulli_inplace_tensor": lambda d, x, g: torch.empty_like(x).bernoulli_(x, generator=g),
    "dropout": lambda d, x, g: F.dropout(x, 0.3, training=True),
    "dropout_inplace": lambda d, x, g: F.dropout(x.clone(), 0.3, training=True, inplace=True),
    "alpha_dropout": lambda d, x, g: F.alpha_dropout(x, 0.2, training=True),
    "feature_alpha_dropout": lambda d, x, g: F.feature_alpha_dropout(x.reshape(1, 3, 4, 1), 0.4, training=True),
    "dropout1d": lambda d, x, g: F.dropout1d(x.reshape(1, 3, 4), 0.5, training=True),
    "dropout2d": lambda d, x, g: F.dropout2d(x.reshape(1, 3, 2, 2), 0.5, training=True),
    "dropout3d": lambda d, x, g: F.dropout3d(x.reshape(1, 3, 2, 2, 1), 0.5, training=True),
    "normal_": lambda d, x, g: torch.empty_like(x).normal_(1.0, 2.0, generator=g),
    "normal_tensor_tensor": lambda d, x, g: torch.normal(x, x + 1, generator=g),
    "normal_tensor_float": lambda d, x, g: torch.normal(x, 0.5, generator=g),
    "normal_float_tensor": lambda d, x, g: torch.normal(0.5, x, generator=g),
    "normal_float_float": lambda d, x, g: torch.normal(2.0, 3.0, (5,), device=d, generator=g),
    "uniform_": lambda d, x, g: torch.empty_like(x).uniform_(-2, 3, generator=g),
    "exponential_": lambda d, x, g: torch.empty_like(x).exponential_(1.5, generator=g),
    "geometric_": lambda d, x, g: torch.empty_like(x).geometric_(0.3, generator=g),
    "cauchy_": lambda d, x, g: torch.empty_like(x).cauchy_(0.0, 1.0, generator=g),
    "log_normal_": lambda d, x, g: torch.empty_like(x).log_normal_(0.0, 0.5, generator=g),
    "random_": lambda d, x, g: torch.empty(5, dtype=torch.int64, device=d).random_(generator=g),
    "random_to": lambda d, x, g: torch.empty(5, device=d).random_(10, generator=g),
    "random_from_to": lambda d, x, g: torch.empty(5, dtype=torch.int32, device=d).random_(-3, 4, generator=g),
    "multinomial": lambda d, x, g: torch.multinomial(_probabilities(d), 4, generator=g),
    "multinomial_replacement": lambda d, x, g: torch.multinomial(x, 5, replacement=True, generator=g),
    "poisson": lambda d, x, g: torch.poisson(x * 4, generator=g),
    "rrelu": lambda d, x, g: F.rrelu(x - 0.5, training=True),
    "rrelu_inplace": lambda d, x, g: F.rrelu_(x.clone() - 0.5, training=True),
    "binomial": lambda d, x, g: torch.binomial(torch.full_like(x, 10.0), x, generator=g),
    "standard_gamma": lambda d, x, g: torch._standard_gamma(x + 0.5, generator=g),
    "dirichlet": lambda d, x, g: torch._sample_dirichlet(x + 0.5, generator=g),
    "sdpa_dropout": lambda d, x, g: F.scaled_dot_product_attention(
        x.reshape(1, 1, 3, 4), x.reshape(1, 1, 3, 4), x.reshape(1, 1, 3, 4), dropout_p=0.5),
}
# ops that take no ``generator`` argument in their Python API
_NO_GENERATOR = {"rand_like", "randn_like", "randint_like", "dropout", "dropout_inplace", "alpha_dropout",
                 "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu", "rrelu_inplace",
                 "sdpa_dropout"}


def _input(device):
    return torch.linspace(0.1, 0.9, 12).reshape(3, 4).to(device)


def _run(names, device, seed=0, generator=None, mix=True):
    """Run ``names`` in order after seeding; between draws, pointwise work that adaptive
    eager fuses with the random ops."""
    torch.manual_seed(seed)
    x = _input(device)
    drawn = []
    for name in names:
        value = RANDOM_OPS[name](device, x, generator if name not in _NO_GENERATOR else None)
        drawn.append(value)
        if mix and value.is_floating_point():
            drawn.append(value * 2 + 1)  # fuses with the draw
    return [t.cpu() for t in drawn]


def _assert_identical(neuron, cpu):
    assert len(neuron) == len(cpu)
    for index, (a, b) in enumerate(zip(neuron, cpu)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), (
            f"draw {index} differs from the CPU's:\n{a}\n{b}")


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_each_random_op_then_another_draws_as_on_the_cpu(name):
    """One op, then a draw of another kind: both equal the CPU's (the second one shows
    that the first consumed the generator exactly as the CPU's does)."""
    sequence = [name, "rand_like", name, "bernoulli_p_tensor"]
    _assert_identical(_run(sequence, "neuron"), _run(sequence, "cpu"))


@pytest.mark.parametrize("program", [
    ["bernoulli_p_tensor", "rand_like"],
    ["exponential_", "rand_like"],
    ["randn_like", "dropout"],
    ["dropout", "randn_like"],
])
def test_the_reported_interleavings(program):
    _assert_identical(_run(program, "neuron", mix=False), _run(program, "cpu", mix=False))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=st.lists(st.sampled_from(sorted(RANDOM_OPS)), min_size=1, max_size=10), seed=st.integers(0, 2**31))
def test_random_sequences_of_random_ops_draw_as_on_the_cpu(program, seed):
    _assert_identical(_run(program, "neuron", seed), _run(program, "cpu", seed))


def test_an_explicit_cpu_generator_shared_with_host_draws_keeps_program_order():
    """A CPU generator passed to neuron ops and used by CPU ops in between: the draws
    happen in program order, as in the all-CPU program (the device may not run them
    later on its queue)."""

    def program(device):
        g = torch.Generator().manual_seed(11)
        first = torch.rand(4, device=device, generator=g)
        host = torch.rand(4, generator=g)  # a host draw from the same generator
        second = torch.randn(3, device=device, generator=g) * 2
        return [first.cpu(), host, second.cpu()]

    _assert_identical(program("neuron"), program("cpu"))


def test_seeding_and_rng_state_round_trip_like_the_cpu():
    torch.manual_seed(3)
    x = _input("neuron")
    state = torch.neuron.get_rng_state()
    a = F.dropout(x, 0.5, True).cpu()
    torch.neuron.set_rng_state(state)
    b = F.dropout(x, 0.5, True).cpu()
    assert torch.equal(a, b)
    torch.manual_seed(3)
    assert torch.equal(F.dropout(_input("cpu"), 0.5, True), a)


def test_a_training_loop_with_dropout_draws_as_on_the_cpu():
    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.rand(4, 6, device=device)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [t.cpu() for t in losses] + [p.detach().cpu() for p in model.parameters()]

    _assert_identical(train("neuron"), train("cpu"))


def test_random_ops_keep_their_order_inside_one_fused_window():
    """Adaptive eager puts these draws in one window, where fusion could run the last
    draw first (it fuses with the first op); the planner must keep their order: a
    generator dependency joins every two random ops, ``binomial`` (not tagged random, but
    it takes a generator) included."""
    if not adaptive_eager.is_enabled():
        pytest.skip("adaptive eager only")

    def program(device):
        torch.manual_seed(9)
        x = _input(device)
        count = torch.full_like(x, 4.0)
        a = torch.rand_like(x) + x
        b = torch.bernoulli(x) * 3
        d = torch.binomial(count, x)
        return [t.cpu() for t in (d, b, a)]

    _assert_identical(program("neuron"), program("cpu"))


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_random_ops_are_queued_not_run_on_the_host(name):
    """Drawing on the device's generator keeps random ops on the queue: no sync point."""
    x = _input("neuron")
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    RANDOM_OPS[name]("neuron", x, None)
    assert dict(adaptive_eager.stats()["sync_points"]) == {}


def test_attention_without_dropout_is_a_kernel_not_a_random_op_on_the_host(any_mode):
    """The CPU's fused attention kernel is tagged random for its dropout: with
    ``dropout_p=0`` it draws nothing, so it is queued as a kernel, with no sync point and
    no swap of the generator's state (a decode step calls it once per layer)."""
    q, k, v = (torch.randn(1, 4, 8, 16) for _ in range(3))
    on = [t.to("neuron") for t in (q, k, v)]
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    out = torch.nn.functional.scaled_dot_product_attention(*on, is_causal=True)
    assert adaptive_eager.stats()["sync_points"] == {}
    torch.testing.assert_close(out.cpu(), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_attention_with_dropout_still_draws_as_the_cpu_draws(any_mode):
    q, k, v = (torch.randn(1, 4, 8, 16) for _ in range(3))
    on = [t.to("neuron") for t in (q, k, v)]
    torch.manual_seed(3)
    out = torch.nn.functional.scaled_dot_product_attention(*on, dropout_p=0.5)
    torch.manual_seed(3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(out.cpu(), expected)
