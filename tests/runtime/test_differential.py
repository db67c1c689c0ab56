"""Differential testing with hypothesis: random programs of pointwise, reduction, matmul,
view, in-place-on-view, broadcasting, mixed-dtype and seeded-random ops run on the CPU, in
strict eager and in adaptive eager; every tensor they leave must agree.

Programs also drop their references to values at random, so values die mid-program: the
adaptive window then eliminates dead intermediates and the planner reorders around them,
as in real code.

The default run tries 200 programs. ``HYPOTHESIS_PROFILE=thorough python -m pytest
tests/runtime/test_differential.py`` tries 5,000, and ``HYPOTHESIS_PROFILE=long`` 10,000 (about
20 minutes here; the figure in the closing note of the correctness issue).
"""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaptive_eager

settings.register_profile("default", max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("thorough", max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=10000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

SHAPES = [(4, 6), (6,), (4, 1), (1, 6), ()]  # all broadcast to (4, 6)

UNARY = {
    "relu": torch.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "neg": torch.neg,
    "exp_clamped": lambda t: t.clamp(-5, 5).exp(),
    "sqrt_abs": lambda t: t.abs().sqrt(),
    "scale": lambda t: t * 1.5,
    "shift": lambda t: t - 0.25,
    "gelu": F.gelu,
}
BINARY = {
    "add": torch.add,
    "mul": torch.mul,
    "sub": torch.sub,
    "maximum": lambda a, b: torch.maximum(a, b.to(a.dtype)),
    "where": lambda a, b: torch.where(a > 0, a, b),
}
REDUCE = {
    "sum_last": lambda t: t.sum(-1, keepdim=True) if t.dim() else t,
    "amax_first": lambda t: t.amax(0, keepdim=True) if t.dim() else t,
    "mean_all": lambda t: t.mean(),
}
CASTS = {
    "to_bf16": lambda t: t.to(torch.bfloat16),
    "to_f64": lambda t: t.to(torch.float64),
    "to_f32": lambda t: t.float(),
    "positive_mask": lambda t: (t > 0).long(),
}

instruction = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY)), st.integers(0, 63)),
    st.tuples(st.just("binary"), st.sampled_from(sorted(BINARY)), st.integers(0, 63), st.integers(0, 63)),
    st.tuples(st.just("reduce"), st.sampled_from(sorted(REDUCE)), st.integers(0, 63)),
    st.tuples(st.just("cast"), st.sampled_from(sorted(CASTS)), st.integers(0, 63)),
    st.tuples(st.just("matmul"), st.integers(0, 63)),
    st.tuples(st.just("view"), st.sampled_from(["expand", "unsqueeze_squeeze", "row"]), st.integers(0, 63)),
    st.tuples(st.just("inplace_view"), st.sampled_from(["row_mul", "strided_add", "column_fill"]), st.integers(0, 63)),
    st.tuples(st.just("dropout"), st.integers(0, 63)),
    st.tuples(st.just("drop"), st.integers(0, 63)),
    st.tuples(st.just("drop"), st.integers(0, 63)),
)


def run_program(program, inputs, weight, device):
    pool = [t.clone().to(device) for t in inputs]
    weight = weight.to(device)
    torch.manual_seed(1234)
    for step in program:
        kind = step[0]
        if kind == "unary":
            t = pool[step[2] % len(pool)]
            if t.dtype in (torch.int64, torch.bool):
                t = t.float()
            pool.append(UNARY[step[1]](t))
        elif kind == "binary":
            pool.append(BINARY[step[1]](pool[step[2] % len(pool)], pool[step[3] % len(pool)]))
        elif kind == "reduce":
            t = pool[step[2] % len(pool)]
            pool.append(REDUCE[step[1]](t if t.is_floating_point() else t.float()))
        elif kind == "cast":
            pool.append(CASTS[step[1]](pool[step[2] % len(pool)]))
        elif kind == "matmul":
            t = pool[step[1] % len(pool)]
            if t.shape == (4, 6):
                pool.append(t.to(weight.dtype) @ weight)
        elif kind == "view":
            t = pool[step[2] % len(pool)]
            if step[1] == "expand":
                pool.append(t.expand(4, 6))
            elif step[1] == "unsqueeze_squeeze":
                pool.append(t.unsqueeze(0).squeeze(0))
            elif t.shape == (4, 6):
                pool.append(t[2])
        elif kind == "inplace_view":
            t = pool[step[2] % len(pool)]
            if t.shape == (4, 6) and t.is_floating_point():
                if step[1] == "row_mul":
                    t[1].mul_(2)
                elif step[1] == "strided_add":
                    t[:, ::2].add_(1)
                else:
                    t[:, 3].fill_(-1)
        elif kind == "dropout":
            t = pool[step[1] % len(pool)]
            if t.is_floating_point():
                pool.append(F.dropout(t, 0.25, training=True))
        elif kind == "drop" and len(pool) > 2:
            del pool[step[1] % len(pool)]  # the value dies here: no reference is left
    return [t.cpu() for t in pool]


def tolerance(dtype):
    return {"rtol": 1.6e-2, "atol": 1e-2} if dtype is torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}


@given(
    program=st.lists(instruction, min_size=1, max_size=14),
    shapes=st.lists(st.sampled_from(SHAPES), min_size=2, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_random_programs_agree_on_cpu_strict_and_adaptive(program, shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    weight = torch.randn(6, 6, generator=generator)
    try:
        expected = run_program(program, inputs, weight, "cpu")
    except RuntimeError as cpu_error:  # e.g. writing in place into an expanded tensor
        for adaptive in (False, True):
            with adaptive_eager.mode(adaptive), pytest.raises(RuntimeError) as device_error:
                run_program(program, inputs, weight, "neuron")
            assert str(device_error.value).splitlines()[0] == str(cpu_error).splitlines()[0]
        return
    with adaptive_eager.mode(False):
        strict = run_program(program, inputs, weight, "neuron")
    with adaptive_eager.mode(True):
        adaptive = run_program(program, inputs, weight, "neuron")
    for cpu, s, a in zip(expected, strict, adaptive):
        assert s.dtype == cpu.dtype and a.dtype == cpu.dtype and s.shape == cpu.shape == a.shape
        torch.testing.assert_close(s, cpu, equal_nan=True, **tolerance(cpu.dtype))
        torch.testing.assert_close(a, cpu, equal_nan=True, **tolerance(cpu.dtype))


def test_same_program_same_plan_same_names_same_statistics():
    def run():
        adaptive_eager.clear_caches()
        adaptive_eager.reset_stats()
        with adaptive_eager.mode(True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)).to("neuron")
            x = torch.randn(4, 8).to("neuron")
            loss = model(x).pow(2).mean()
            loss.backward()
            loss.item()
        stats = adaptive_eager.stats()
        for volatile in ("memory",):
            stats.pop(volatile)
        return stats

    first, second = run(), run()
    assert first == second
    assert first["fused_kernels"] > 0
