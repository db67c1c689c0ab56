"""Compiled mode: torch.compile's ``neuron`` backend (adaptive_eager/compiler.py) runs
whole graphs through the fusion engine, with results equal to CPU eager."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager_device.core.config import CONFIG

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.workloads import GPT, Llama  # noqa: E402

HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no recompile limit carried over from another test's graphs
    yield
    torch._dynamo.reset()


def compiled_stats():
    return adaptive_eager.stats()["compiled"]


def test_backend_neuron_is_found_through_the_entry_point_and_is_the_default_for_neuron_tensors():
    code = ("import torch\n"
            "f = torch.compile(lambda x: (x * 2 + 1).relu().sum())\n"
            "print(f(torch.arange(4.0, device='neuron')).item())\n"
            "import adaptive_eager\n"
            "from torch._dynamo.backends.registry import lookup_backend\n"
            "print(lookup_backend('neuron').__module__, adaptive_eager.stats()['compiled']['graph_calls'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["16.0", "adaptive_eager.compiler", "1"], out.stderr[-2000:]


def test_cpu_graphs_still_go_to_inductor():
    f = torch.compile(lambda x: (x * 2).sum())
    assert f(torch.arange(4.0)).item() == 12.0
    assert compiled_stats()["graphs_captured"] == 0


def test_a_graph_is_planned_whole_beyond_the_eager_window(any_mode):
    # 3 x 200 elementwise ops: more than one adaptive window (NEURON_ADAPTIVE_WINDOW ops) holds
    ops = 3 * 200
    assert ops > CONFIG.window_ops

    def chain(x):
        for _ in range(200):
            x = (x * 1.001 + 0.001).abs()
        return x

    x = torch.randn(64)
    expected = chain(x)
    adaptive_eager.reset_stats()
    eager = chain(x.to("neuron")).cpu()
    eager_launches = adaptive_eager.stats()["kernels_launched"]
    compiled = torch.compile(chain)
    compiled(x.to("neuron")).cpu()  # compile; the plan is cached from now on
    adaptive_eager.reset_stats()
    result = compiled(x.to("neuron")).cpu()
    stats = adaptive_eager.stats()
    torch.testing.assert_close(result, expected)
    torch.testing.assert_close(eager, expected)
    graph = stats["compiled"]
    assert graph["graph_calls"] == 1 and graph["ops"] == ops
    assert graph["launches"] == 1  # one fused kernel for the whole graph
    assert eager_launches > 1  # eager: at least one window per NEURON_ADAPTIVE_WINDOW ops
    (entry,) = [g for g in graph["graphs"].values() if g["calls"]]
    assert entry["plan_cache"]["hits"] == 1 and entry["plan_cache"]["misses"] == 0


def _train(model, device, steps, compiled):
    model = model.to(device)
    # eps damps Adam's m / sqrt(v) for gradients that are rounding noise (attention's key
    # bias: softmax does not depend on it, so its gradient is 0 up to rounding, and Adam
    # would turn any two roundings of 0 into steps of +-lr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 17), generator=generator)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    run = torch.compile(step) if compiled else step
    losses = [run().cpu() for _ in range(steps)]
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_compiled_training_steps_equal_cpu_eager(name):
    torch.manual_seed(0)
    model = {
        "mlp": lambda: nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64)),
        "gpt": lambda: GPT(vocab=64, dim=32, heads=2, layers=1, seq=16),
        "llama": lambda: Llama(vocab=64, dim=32, heads=2, hidden=48, layers=1),
    }[name]()
    reference = copy.deepcopy(model)
    losses, params = _train(model, "neuron", 3, compiled=True)
    expected_losses, expected_params = _train(reference, "cpu", 3, compiled=False)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    for got, want in zip(params, expected_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    stats = compiled_stats()
    kinds = {g["kind"] for g in stats["graphs"].values()}
    assert {"forward", "backward"} <= kinds
    assert stats["launches"] < stats["ops"]  # whole graphs fused, not op by op


def test_graph_breaks_and_new_shapes_recompile_with_their_reason():
    def f(x):
        a = x.sin() * 2
        print("a graph break", file=sys.stderr)
        return (a.cos() + 1).sum(dim=0)

    g = torch.compile(f)
    for n in (3, 4):
        x = torch.randn(n, 5)
        torch.testing.assert_close(g(x.to("neuron")).cpu(), f(x))
    stats = compiled_stats()
    assert stats["graphs_captured"] == 4  # two graphs (the break), each compiled for two shapes
    assert stats["recompiles"]["total"] == 2
    assert all("size mismatch at index 0. expected 3, actual 4" in r for r in stats["recompiles"]["reasons"])


def test_fullgraph_with_a_break_gives_dynamos_error():
    def f(x):
        print("break")
        return x + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(f, fullgraph=True)(torch.ones(2, device="neuron"))


def test_naming_inductor_on_neuron_tensors_warns_once_and_compiles_for_neuron():
    f = torch.compile(lambda x: x.exp().sum(), backend="inductor", mode="reduce-overhead")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = f(torch.ones(3, device="neuron")).item()
    assert result == pytest.approx(3 * 2.718281828)
    assert any("Inductor has no code generator for the neuron device" in str(w.message) for w in caught)
    assert compiled_stats()["graphs_captured"] == 1


def _line_of(text: str) -> int:
    with open(HERE) as handle:
        return next(i for i, line in enumerate(handle, 1) if text in line)


def test_a_deferred_error_in_a_compiled_forward_names_the_users_line_and_the_next_call_recovers():
    def f(x):
        y = x.exp()
        z = y * 3  # the faulty op
        return z.sum()

    g = torch.compile(f)
    x = torch.ones(4)
    assert g(x.to("neuron")).item() == pytest.approx(f(x).item())
    adaptive_eager.inject_fault("aten::mul")
    result = g(x.to("neuron"))
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as raised:
        result.item()
    message = str(raised.value)
    assert f"{HERE}:{_line_of('z = y * 3  # the faulty op')} in f" in message
    assert "aten::mul" in message
    with pytest.raises(adaptive_eager.PoisonedTensorError):
        result.cpu()  # the failed graph's output stays poisoned
    assert g(x.to("neuron")).item() == pytest.approx(f(x).item())  # then it runs again


def test_a_deferred_error_in_a_compiled_backward_names_the_forward_line():
    w = torch.randn(4, 4, requires_grad=True)
    device_w = w.detach().to("neuron").requires_grad_()

    def f(x, w):
        y = x @ w
        z = y.tanh()  # its backward fails
        return z.sum()

    g = torch.compile(f)
    adaptive_eager.inject_fault("aten::tanh_backward")
    g(torch.ones(2, 4, device="neuron"), device_w).backward()
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as raised:
        device_w.grad.cpu()
    assert f"{HERE}:{_line_of('z = y.tanh()  # its backward fails')} in f" in str(raised.value)
    device_w.grad = None
    g(torch.ones(2, 4, device="neuron"), device_w).backward()
    f(torch.ones(2, 4), w).backward()
    torch.testing.assert_close(device_w.grad.cpu(), w.grad)


def test_launch_blocking_raises_inside_the_compiled_call():
    CONFIG.launch_blocking = True

    def f(x):
        return (x.exp() * 3).sum()

    g = torch.compile(f)
    adaptive_eager.inject_fault("aten::mul")
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="aten::mul"):
        g(torch.ones(3, device="neuron"))  # raised here, not at the next sync point


def test_an_op_with_no_device_kernel_runs_through_the_cpu_fallback_inside_a_graph():
    def f(a):
        q, tau = torch.geqrf(a * 2)
        return q.sum() + tau.sum()

    a = torch.randn(4, 3)
    g = torch.compile(f)
    g(a.to("neuron")).cpu()  # compiling runs geqrf once too (FakeTensor: the op on zeros)
    adaptive_eager.reset_stats()
    got = g(a.to("neuron")).cpu()
    torch.testing.assert_close(got, f(a))
    assert adaptive_eager.stats()["fallback_ops"] == {"aten::geqrf": 1}


def test_hugging_face_static_cache_generate_equals_cpu(tiny_static_llama):
    model, ids, expected = tiny_static_llama
    model.to("neuron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers asks for Inductor: compiled for neuron instead
        got = model.generate(ids.to("neuron"), max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(got.cpu(), expected)
    stats = compiled_stats()
    assert stats["graphs_captured"] >= 1 and stats["graph_calls"] >= 5  # decoding ran compiled


def test_a_compiled_optimizer_step_whose_state_the_graph_holds_equals_cpu():
    torch.manual_seed(0)
    cpu_params = [nn.Parameter(torch.randn(8, 8)) for _ in range(3)]
    params = [nn.Parameter(p.detach().to("neuron")) for p in cpu_params]
    for p, q in zip(params, cpu_params):
        q.grad = torch.randn(8, 8)
        p.grad = q.grad.to("neuron")
    optimizers = [torch.optim.AdamW(ps, lr=1e-2) for ps in (params, cpu_params)]
    step = torch.compile(optimizers[0].step)
    for _ in range(3):
        step()
        optimizers[1].step()
    for p, q in zip(params, cpu_params):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    assert compiled_stats()["graph_calls"] >= 3


def test_a_compiled_adamw_steps_per_parameter_fills_join_its_multi_tensor_kernel(monkeypatch):
    # The compiled AdamW step decomposes each moment's lerp: it fills a tensor per
    # parameter with the weight (aten::fill_, one op each) that _foreach_addcmul_ reads.
    # Each fill loops over one tensor of the foreach chain's group, so the multi-tensor
    # kernel holds it, also where the chain is too big for the on-chip rule (realistic
    # sizes; the rule off here): one launch per step, not one more per parameter.
    monkeypatch.setattr(CONFIG, "on_chip_mb", 0)
    torch.manual_seed(0)
    shapes = [(8, 4 + i) for i in range(6)]
    cpu_params = [nn.Parameter(torch.randn(*shape)) for shape in shapes]
    params = [nn.Parameter(p.detach().to("neuron")) for p in cpu_params]
    for p, q in zip(params, cpu_params):
        q.grad = torch.randn_like(q)
        p.grad = q.grad.to("neuron")
    optimizers = [torch.optim.AdamW(ps, lr=1e-2) for ps in (params, cpu_params)]
    step = torch.compile(optimizers[0].step)
    for call in range(3):
        if call == 2:
            params[0].detach().cpu()
            adaptive_eager.reset_stats()
        step()
        optimizers[1].step()
    for p, q in zip(params, cpu_params):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    stats = adaptive_eager.stats()
    assert stats["kernels_launched"] == 1, stats["kernels"]


def test_a_compiled_optimizer_step_writes_its_state_in_place_as_eager_does():
    params = [nn.Parameter(torch.randn(8, 8, device="neuron")) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(8, 8, device="neuron")
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    torch.compile(optimizer.step)()
    graphs = [g for g in compiled_stats()["graphs"].values() if g["calls"]]
    # parameters, exp_avg, exp_avg_sq and step counters: 4 x 3 inputs, updated in place
    # by _foreach_*_ ops, with none of functionalization's copies back
    assert sum(g["inputs_written_in_place"] for g in graphs) == 12


def _mutating_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        doubled = torch.ops.aten.mul.Tensor(a, 2)
        read = torch.ops.aten.add.Tensor(b, 1)  # reads b before a's update lands
        torch.ops.aten.copy_.default(a, doubled)
        return (read,)

    return make_fx(f, tracing_mode="fake")(torch.randn(4), torch.randn(4))


def test_input_mutations_in_place_and_the_traced_graph_when_inputs_alias():
    from adaptive_eager.compiler import GraphRunner

    runner = GraphRunner(_mutating_graph(), "inference")
    assert runner.written_inputs == (0,)
    assert "mul_" in runner.gm.code and "copy_" not in runner.gm.code
    a = torch.arange(4.0, device="neuron")
    (read,) = runner([a, torch.ones(4, device="neuron")])
    assert a.cpu().tolist() == [0, 2, 4, 6] and read.cpu().tolist() == [2, 2, 2, 2]
    a = torch.arange(4.0, device="neuron")
    (read,) = runner([a, a.view(4)])  # b is a: in place, the read would see the update
    assert a.cpu().tolist() == [0, 2, 4, 6] and read.cpu().tolist() == [1, 2, 3, 4]


def test_dynamo_never_traces_into_the_device():
    # Without skipping the device's own Python (device/dynamo.py), Dynamo traces into the
    # device guard that torch.accelerator calls back, and into the recorder, fails there
    # and runs whole frames eagerly: no error, the numbers still right, nothing compiled.
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    counters.clear()
    _train(GPT(vocab=64, dim=32, heads=2, layers=1, seq=16), "neuron", 1, compiled=True)
    assert not counters["unimplemented"], list(counters["unimplemented"])[:3]


def test_a_view_op_is_never_turned_into_its_in_place_variant():
    # detach_ (like t_, squeeze_) changes the input's metadata; a mutated input that a
    # detach reads last must keep its requires_grad and its shape
    from torch.fx.experimental.proxy_tensor import make_fx

    from adaptive_eager.compiler import GraphRunner

    def f(a):
        doubled = torch.ops.aten.mul.Tensor(torch.ops.aten.detach.default(a), 2)
        torch.ops.aten.copy_.default(a, doubled)
        return ()

    runner = GraphRunner(make_fx(f, tracing_mode="fake")(torch.randn(4)), "inference")
    assert "detach_" not in runner.gm.code
    a = torch.arange(4.0, device="neuron").requires_grad_()
    with torch.no_grad():
        runner([a])
    assert a.requires_grad and a.detach().cpu().tolist() == [0, 2, 4, 6]
