"""Unmodified training loops give CPU PyTorch's numbers on `neuron`: losses, gradients and
final parameters (fp32 relative 1e-5; bf16 at bf16 tolerance)."""
import pytest
import torch

import training_loops as loops

pytestmark = pytest.mark.usefixtures("any_mode")  # every test, in strict and adaptive eager

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def compare(neuron, cpu, **tolerances):
    assert set(neuron) == set(cpu)
    for key in cpu:
        a, b = neuron[key], cpu[key]
        if key == "losses":
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **tolerances)
        elif isinstance(b, list):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                if y is None:
                    assert x is None
                else:
                    torch.testing.assert_close(x, y, **tolerances)
        else:
            torch.testing.assert_close(a, b, **tolerances)


@pytest.mark.parametrize(
    "loop",
    [loops.run_mlp_adamw, loops.run_cnn_sgd, loops.run_transformer, loops.run_grad_accumulation],
    ids=["mlp_adamw", "cnn_sgd_momentum_dropout", "transformer_adamw_clip_scheduler", "grad_accumulation"],
)
def test_training_loop_matches_cpu(loop):
    compare(loop("neuron"), loop("cpu"), **FP32)


def test_bfloat16_training_matches_cpu():
    compare(
        loops.run_mlp_adamw("neuron", dtype=torch.bfloat16),
        loops.run_mlp_adamw("cpu", dtype=torch.bfloat16),
        rtol=1.6e-2,
        atol=1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_loop_follows_cuda_policy(dtype):
    compare(loops.run_autocast("neuron", dtype), loops.run_autocast("cpu", dtype), **FP32)


def test_no_grad_inference_builds_no_graph():
    model = torch.nn.Linear(4, 2).to("neuron").eval()
    with torch.no_grad():
        out = model(torch.randn(3, 4, device="neuron"))
    assert not out.requires_grad and out.grad_fn is None
