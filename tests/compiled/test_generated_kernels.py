"""Compiled mode's fused kernels as Inductor-generated CPU code (adaptive_eager/generated.py):
compiled in the background once a graph replays, swapped in when ready, results equal to
the CPU within tolerance, the plan's statistics unchanged, a failure inside a generated
kernel still names the op and the user's line (written inputs restored), the worker runs
them through their C++ entry point without taking the GIL, and the compiled code comes
from Inductor's disk cache in another process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn

import adaptive_eager
from adaptive_eager import generated
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.hardware.execution_queue import QUEUE

WAIT_S = 600  # a cold Inductor compile on a loaded two-core machine


@pytest.fixture(autouse=True)
def inductor_on():
    torch._dynamo.reset()
    saved = CONFIG.compiled_inductor
    CONFIG.compiled_inductor = True
    yield
    CONFIG.compiled_inductor = saved
    torch._dynamo.reset()


def runs(key="generated_runs"):
    return adaptive_eager.stats()["compiled"]["generated_kernels"][key]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def test_train_steps_with_generated_kernels_equal_cpu_and_keep_the_plan_statistics():
    torch.manual_seed(0)
    cpu_model = Block()
    model = Block()
    model.load_state_dict(cpu_model.state_dict())
    model.to("neuron")
    x = torch.randn(8, 16)
    xn = x.to("neuron")
    step = torch.compile(model)
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(m, o, inp):
        loss = m(inp).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    figures = []
    for i in range(5):
        if i == 2:  # the plans replayed once by now: their kernels are compiling
            assert generated.wait(WAIT_S)
        before = (COUNTERS.kernels_launched, COUNTERS.device_time_us)
        runs_before = runs()
        loss = train(step, opt, xn).cpu()
        figures.append((COUNTERS.kernels_launched - before[0], round(COUNTERS.device_time_us - before[1], 6),
                        runs() - runs_before))
        expected = train(cpu_model, cpu_opt, x)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    stats = adaptive_eager.stats()["compiled"]["generated_kernels"]
    assert stats["kernels_compiled"] >= 2, stats  # forward and backward kernels
    assert figures[3][2] > 0 and figures[4][2] > 0, figures  # generated code ran, swapped in
    assert figures[1][2] == 0, figures  # (not before it was compiled)
    # the plan's launches and simulated time, whichever code ran the kernels
    assert figures[1][:2] == figures[3][:2] == figures[4][:2], figures


def test_static_cache_generate_with_generated_kernels_equals_cpu(tiny_static_llama):
    model, ids, expected = tiny_static_llama
    model.to("neuron")
    model.forward = torch.compile(model.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers asks for Inductor: compiled for neuron instead
        first = model.generate(ids.to("neuron"), max_new_tokens=6, do_sample=False, cache_implementation="static")
        assert generated.wait(WAIT_S)
        before, without_gil = runs(), runs("generated_runs_without_gil")
        got = model.generate(ids.to("neuron"), max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(first.cpu(), expected)
    assert torch.equal(got.cpu(), expected)
    assert runs() - before >= 5, adaptive_eager.stats()["compiled"]["generated_kernels"]  # each decoding step
    assert runs("generated_runs_without_gil") - without_gil == runs() - before  # every one in C++


def test_the_worker_runs_a_generated_kernel_while_the_host_holds_the_gil():
    """The host keeps the GIL (pure Python, no switch for a minute) while the worker runs
    the graph's generated kernel: it finishes only if the worker never asks for the GIL."""
    fn = torch.compile(lambda x, y: ((x @ y).relu() * 2.0 + 1.0).sum(0))
    x = torch.randn(64, 64, device="neuron")
    for _ in range(2):
        fn(x, x).cpu()
    assert generated.wait(WAIT_S)
    fn(x, x).cpu()
    worker = QUEUE._worker

    def ran_without_gil():  # (the worker's own counter: reading it neither waits nor drops the GIL)
        return worker.counts()["generated_runs_without_gil"]

    before = ran_without_gil()
    out = fn(x, x)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        QUEUE.ring()
        deadline = time.perf_counter() + 20.0
        while ran_without_gil() == before and time.perf_counter() < deadline:
            pass
        ran = ran_without_gil() - before
    finally:
        sys.setswitchinterval(switch)
    assert ran == 1, "the worker waited for the GIL"
    torch.testing.assert_close(out.cpu(), ((x.cpu() @ x.cpu()).relu() * 2.0 + 1.0).sum(0))


def cache_write(cache, pos, value, rows):
    cache.index_copy_(0, pos, value * 2.0)
    return (cache * 0.5).index_select(0, rows) + 1.0  # the line a failure names


WRAPPER = """
#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
void inductor_entry_impl(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {
    py::gil_scoped_release_simple release;
    auto inputs = steal_from_raw_handles_to_raii_handles(input_handles, 1);
    BODY
} // inductor_entry_impl
static PyObject* inductor_entry_cpp_py(PyObject* self, PyObject* args) { return nullptr; }
"""


def test_only_a_wrapper_with_no_python_in_its_entry_point_loses_its_gil_release():
    plain = WRAPPER.replace("BODY", "output_handles[0] = inputs[0].release();")
    changed = generated._without_gil_release(plain)
    assert changed == plain.replace("py::gil_scoped_release_simple release;", "")
    assert "PyObject" in changed  # (the binding after the entry point stays as it was)
    calls_python = WRAPPER.replace("BODY", "RAIIPyObject op(PyObject_GetAttrString(module, \"op\"));")
    assert generated._without_gil_release(calls_python) is None
    assert generated._without_gil_release(plain.replace("} // inductor_entry_impl", "}")) is None
    release = "py::gil_scoped_release_simple release;"
    elsewhere = plain.replace(f"    {release}\n", "") + release  # a release outside the entry point
    assert generated._without_gil_release(elsewhere) is None


def test_the_gil_release_is_removed_only_for_the_compiling_thread_and_only_while_it_compiles():
    from torch._inductor.codecache import CppWrapperCodeCache

    seen = []

    def record(cls, argtypes, main_code, *args, **kwargs):
        seen.append(main_code)
        return lambda: None

    saved = CppWrapperCodeCache.__dict__.get("load_pybinding_async")
    CppWrapperCodeCache.load_pybinding_async = classmethod(record)  # stands for Inductor's build
    try:
        source = WRAPPER.replace("BODY", "output_handles[0] = inputs[0].release();")
        with generated._entry_points_without_gil():
            CppWrapperCodeCache.load_pybinding_async([], source)
            other = threading.Thread(target=CppWrapperCodeCache.load_pybinding_async, args=([], source))
            other.start()
            other.join()
        assert CppWrapperCodeCache.__dict__["load_pybinding_async"].__func__ is record  # restored
        CppWrapperCodeCache.load_pybinding_async([], source)
    finally:
        if saved is None:
            del CppWrapperCodeCache.load_pybinding_async
        else:
            CppWrapperCodeCache.load_pybinding_async = saved
    release = "py::gil_scoped_release_simple release;"
    assert [release in code for code in seen] == [False, True, True]


def test_a_failure_inside_a_generated_kernel_names_the_op_and_line_and_restores_written_inputs():
    fn = torch.compile(cache_write)
    cache = torch.zeros(8, 4, device="neuron")
    value = torch.ones(2, 4, device="neuron")
    pos = torch.tensor([1, 2], device="neuron")
    rows = torch.tensor([1, 3], device="neuron")
    for _ in range(2):
        fn(cache, pos, value, rows)
    assert generated.wait(WAIT_S)
    before = runs()
    out = fn(cache, pos, value, rows).cpu()
    assert runs() > before  # the generated kernel ran
    torch.testing.assert_close(out, torch.tensor([[2.0] * 4, [1.0] * 4]))
    kept = cache.cpu()
    bad = torch.tensor([1, 99], device="neuron")
    fn(cache, pos, value, bad)
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as raised:
        torch.neuron.synchronize()
    message = str(raised.value)
    assert "aten::index_select (inside fused kernel" in message, message
    line = cache_write.__code__.co_firstlineno + 2  # its return statement
    assert f"{os.path.basename(__file__)}:{line} in cache_write" in message, message
    torch.testing.assert_close(cache.cpu(), kept)  # the written input: as before the call's failure
    assert adaptive_eager.stats()["compiled"]["generated_kernels"]["generated_failures"] >= 1


CHILD = textwrap.dedent("""
    import torch, adaptive_eager
    from adaptive_eager import generated
    def f(x, y):
        return (x * y + 1.0).relu().sum(0) * 3.0
    g = torch.compile(f)
    x = torch.arange(12.0, device="neuron").reshape(3, 4)
    for _ in range(2):
        g(x, x)
    assert generated.wait(600)
    out = g(x, x).cpu()
    assert torch.allclose(out, f(x.cpu(), x.cpu()))
    stats = adaptive_eager.stats()["compiled"]["generated_kernels"]
    from torch._dynamo.utils import counters
    print("RESULT", stats["kernels_compiled"], stats["generated_runs_without_gil"], counters["inductor"]["fxgraph_cache_hit"])
""")


def test_the_generated_code_comes_from_the_disk_cache_in_a_second_process():
    env = dict(os.environ, NEURON_COMPILED_INDUCTOR="1")
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")][-1]
        results.append([int(v) for v in line.split()[1:]])
    compiled, ran, hits = results[1]
    assert compiled >= 1 and ran >= 1 and hits >= 1, results


EXIT_WHILE_COMPILING = textwrap.dedent("""
    import torch, adaptive_eager
    def f(x, y):
        return (x * y - 2.0).sigmoid().sum(1) * 7.0
    g = torch.compile(f)
    x = torch.randn(5, 6, device="neuron")
    for _ in range(3):
        g(x, x).cpu()
    print(adaptive_eager.stats()["compiled"]["generated_kernels"]["plans_requested"])
""")


def test_a_process_exiting_while_a_kernel_compiles_exits_cleanly():
    env = dict(os.environ, NEURON_COMPILED_INDUCTOR="1")
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]  # (it aborted: a daemon thread stopped inside Inductor)
    assert done.stdout.split()[-1] == "1"  # a compile was asked for
