"""bench/wrapper.py, the floor host cost per op is read against (``python -m bench
--wrapper``): the pass-through wrapper computes exactly what CPU eager computes, and
every op of the step goes through it (an op whose result escaped unwrapped would run
as plain CPU eager and make the floor look cheaper than it is)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import measure, wrapper  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402


def _dispatched(step) -> int:
    """Ops the wrapper's __torch_dispatch__ runs in one step."""
    calls = [0]
    original = wrapper.PassThrough.__dict__["__torch_dispatch__"].__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls[0] += 1
        return original(cls, func, types, args, kwargs)

    wrapper.PassThrough.__torch_dispatch__ = classmethod(counting)
    try:
        step()
    finally:
        wrapper.PassThrough.__torch_dispatch__ = classmethod(original)
    return calls[0]


@pytest.mark.parametrize("name", ["gpt", "llama", "decode"])
def test_the_wrapper_runs_every_op_and_computes_what_cpu_computes(name):
    torch.set_num_threads(1)
    cpu_step = WORKLOADS[name].build("cpu")
    wrapped_step = wrapper.build_wrapped(WORKLOADS[name])
    for _ in range(2):  # past the first step's optimizer state
        expected, got = cpu_step(), wrapped_step()
        assert type(got) is wrapper.PassThrough
        torch.testing.assert_close(wrapper.unwrap(got), expected, rtol=0, atol=0)
    counter = measure._CountOps(views=True)
    with counter:
        cpu_step()
    dispatched = _dispatched(wrapped_step)
    if name == "decode":
        assert dispatched == counter.ops > 1000
    else:
        # a training step also runs ops that touch no wrapped tensor: factories and their
        # chain (the causal mask), AdamW's step counters (CPU tensors on any device) and
        # profiler markers; and clip_grad_norm_ takes its per-tensor path for a subclass
        assert counter.ops >= dispatched >= 0.9 * counter.ops > 500


def test_measure_interleaves_the_wrapper():
    result = measure.measure("decode", "strict", steps=1, warmup=1, vs_wrapper=True)
    assert result["max_abs_diff"] == 0.0
    assert result["wrapper_ops_per_step"] == measure._count_ops(WORKLOADS["decode"].build("cpu"))
    for key in ("wrapper_wall_ms_per_step", "wrapper_host_us_per_op", "wall_vs_wrapper", "host_per_op_vs_wrapper"):
        assert result[key] > 0, key
