"""OpInfo coverage, fast subset: commonly used ops must match CPU on ``neuron``.

The full sweep over PyTorch's whole ``op_db`` is ``python bench/op_coverage.py``; this
runs the same harness (``bench/op_coverage.py``) on a representative set, one test per op
so each failure is reported on its own. ``pass_fallback`` (correct, but some aten op ran on
the CPU fallback) is accepted here; the sweep reports it.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import types

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import op_coverage  # noqa: E402

pytestmark = pytest.mark.usefixtures("any_mode")  # every test, in strict and adaptive eager


# OpInfo keys (``name`` or ``name.variant_test_name``), all in torch 2.13's op_db.
COMMON_OPS = [
    # elementwise arithmetic and math
    "add", "sub", "mul", "div.no_rounding_mode", "pow", "neg", "exp", "log", "sqrt", "rsqrt",
    "tanh", "sigmoid", "clamp", "maximum", "where", "masked_fill",
    # activations
    "nn.functional.relu", "nn.functional.silu", "nn.functional.leaky_relu", "nn.functional.gelu",
    # matrix products
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear",
    # reductions and scans
    "sum", "mean", "amax", "var", "argmax", "cumsum", "topk", "sort",
    # normalization and softmax
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.batch_norm",
    # shape and indexing
    "cat", "stack", "transpose", "permute", "reshape", "view", "split", "expand", "index_select",
    "gather", "scatter_add", "index_put",
    # layers and losses
    "nn.functional.embedding", "nn.functional.conv2d", "nn.functional.max_pool2d",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss",
    "nn.functional.scaled_dot_product_attention",
    # random (shape and dtype only) and factories
    "nn.functional.dropout", "full", "zeros_like",
]

# Gradients against the CPU's (float32), and bfloat16 forward against the CPU's bfloat16.
BACKWARD_OPS = [
    "add", "mul", "div.no_rounding_mode", "pow", "exp", "log", "sqrt", "tanh", "sigmoid", "clamp", "where",
    "nn.functional.relu", "nn.functional.silu", "nn.functional.gelu",
    "matmul", "bmm", "addmm", "nn.functional.linear",
    "sum", "mean", "amax", "var", "cumsum",
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.batch_norm",
    "cat", "transpose", "reshape", "expand", "index_select", "gather", "index_put",
    "nn.functional.embedding", "nn.functional.conv2d", "nn.functional.max_pool2d",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.scaled_dot_product_attention",
    "fft.hfft", "mvlgamma.mvlgamma_p_3",  # once failed backward on neuron (test_op_regressions.py)
]
BF16_OPS = [
    "add", "mul", "div.no_rounding_mode", "pow", "exp", "rsqrt", "tanh", "sigmoid", "maximum", "where",
    "nn.functional.silu", "nn.functional.gelu",
    "matmul", "bmm", "addmm", "nn.functional.linear",
    "sum", "mean", "amax", "var", "cumsum", "topk", "sort",
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.batch_norm",
    "native_layer_norm",  # once returned float32 statistics on neuron (test_op_regressions.py)
    "cat", "index_select", "scatter_add", "nn.functional.embedding", "nn.functional.conv2d",
    "nn.functional.cross_entropy", "nn.functional.scaled_dot_product_attention",
]

SAMPLES = 4


@pytest.fixture(scope="module")
def opinfos():
    return {op_coverage.op_key(opinfo): opinfo for opinfo in op_coverage.load_op_db()}


def _assert_passes(record: dict, label: str) -> None:
    """``pass`` or ``pass_fallback`` (correct, some op on the CPU fallback), on compared samples."""
    assert record["outcome"] in ("pass", "pass_fallback"), (
        f"{label}: {record['outcome']}: {record['reason']}; "
        f"sample #{record.get('failing_sample_index')}: {record.get('failing_sample')}"
    )
    assert record["samples_compared"] > 0


@pytest.mark.parametrize("key", COMMON_OPS)
def test_common_op_matches_cpu(key, opinfos):
    assert key in opinfos, f"{key} is not in op_db any more: update COMMON_OPS"
    _assert_passes(op_coverage.run_opinfo(opinfos[key], max_samples=SAMPLES), key)


@pytest.mark.parametrize("key", BACKWARD_OPS)
def test_common_op_gradients_match_cpu(key, opinfos):
    assert key in opinfos, f"{key} is not in op_db any more: update BACKWARD_OPS"
    assert opinfos[key].supports_autograd, key
    _assert_passes(op_coverage.run_opinfo(opinfos[key], max_samples=SAMPLES, backward=True), f"{key} backward")


@pytest.mark.parametrize("key", BF16_OPS)
def test_common_op_matches_cpu_in_bfloat16(key, opinfos):
    assert key in opinfos, f"{key} is not in op_db any more: update BF16_OPS"
    _assert_passes(op_coverage.run_opinfo(opinfos[key], max_samples=SAMPLES, dtype=torch.bfloat16), f"{key} bfloat16")


def _with_op(opinfo, op):
    """A copy of ``opinfo`` that calls ``op`` instead."""
    clone = copy.copy(opinfo)
    clone.op = op
    return clone


class _WrongOnNeuronBackward(torch.autograd.Function):
    """``3 * x`` whose gradient is a little off on neuron only: a silent wrong gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * (3.01 if grad.device.type == "neuron" else 3.0)


def test_harness_reports_a_device_failure(opinfos):
    """A kernel failing on the device (fault injection) is a ``fail`` naming the op."""
    from adaptive_eager_device.hardware.execution_queue import QUEUE, FaultInjector

    QUEUE.faults = FaultInjector("aten::mul:1")  # conftest resets it
    record = op_coverage.run_opinfo(opinfos["mul"], max_samples=1)
    assert record["outcome"] == "fail"
    assert record["reason"].startswith("NeuronRuntimeError: aten::mul"), record["reason"]
    assert "injected fault" in record["reason"]


def test_harness_reports_a_device_failure_in_backward(opinfos):
    """A backward kernel failing on the device is a backward ``fail`` naming the op."""
    from adaptive_eager_device.hardware.execution_queue import QUEUE, FaultInjector

    QUEUE.faults = FaultInjector("aten::threshold_backward:1")  # relu's backward; conftest resets it
    record = op_coverage.run_opinfo(opinfos["nn.functional.relu"], max_samples=1, backward=True)
    assert record["outcome"] == "fail"
    assert record["reason"].startswith("NeuronRuntimeError: aten::threshold_backward"), record["reason"]


def test_harness_reports_a_wrong_gradient(opinfos):
    record = op_coverage.run_opinfo(_with_op(opinfos["nn.functional.relu"], _WrongOnNeuronBackward.apply),
                                    max_samples=2, backward=True)
    assert record["outcome"] == "fail"
    assert record["reason"].startswith("mismatch: grad of input #0"), record["reason"]
    # the same op forward only: nothing wrong there
    forward = op_coverage.run_opinfo(_with_op(opinfos["nn.functional.relu"], _WrongOnNeuronBackward.apply),
                                     max_samples=2)
    assert forward["outcome"] == "pass", forward["reason"]


def test_harness_reports_a_wrong_bfloat16_result(opinfos):
    def off_by_a_little_on_neuron(x, *args, **kwargs):
        result = torch.exp(x, *args, **kwargs)
        return result * 1.05 if result.device.type == "neuron" else result

    record = op_coverage.run_opinfo(_with_op(opinfos["exp"], off_by_a_little_on_neuron), max_samples=2,
                                    dtype=torch.bfloat16)
    assert record["outcome"] == "fail"
    assert record["reason"].startswith("mismatch"), record["reason"]


def test_bfloat16_tolerances_come_from_the_opinfo():
    from torch.testing._internal.common_device_type import toleranceOverride, tol
    from torch.testing._internal.opinfo.core import DecorateInfo

    opinfo = types.SimpleNamespace(decorators=[DecorateInfo(
        toleranceOverride({torch.bfloat16: tol(atol=0.1, rtol=0.2), torch.float32: tol(atol=1e-6, rtol=1e-7)}),
        "TestCommon", "test_compare_cpu")], skips=())
    assert op_coverage.tolerances(opinfo, torch.bfloat16) == {"atol": 0.1, "rtol": 0.2}
    # never tighter than assert_close's defaults for the dtype
    assert op_coverage.tolerances(opinfo, torch.float32) == {"atol": 1e-5, "rtol": 1.3e-6}
    assert op_coverage.tolerances(types.SimpleNamespace(decorators=[], skips=()), torch.bfloat16) == {}


def test_harness_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "coverage.json"
    argv = ["--ops", "add,nn.functional.dropout,nn.functional.relu", "--samples", "2", "--json", str(path)]
    assert op_coverage.main(argv) == 0
    result = json.loads(path.read_text())
    assert set(result) == {"summary", "ops"}
    configs = ["float32/strict/forward", "float32/adaptive/forward", "bfloat16/strict/forward",
               "bfloat16/adaptive/forward", "float32/strict/backward", "float32/adaptive/backward"]
    assert list(result["summary"]["configs"]) == configs
    assert set(result["ops"]) == {"add", "nn.functional.dropout", "nn.functional.relu"}
    for per_config in result["ops"].values():
        assert set(per_config) == set(configs)
        for record in per_config.values():
            assert {"outcome", "reason", "fallback_ops"} <= set(record)
    assert "nn.functional.dropout" in result["summary"]["shape_dtype_only"]
    for name, summary in result["summary"]["configs"].items():
        assert summary["pass"] + summary["pass_fallback"] + summary["fail"] + summary["skip"] == 3, name
    assert result["ops"]["add"]["float32/adaptive/backward"]["outcome"] == "pass"
    out = capsys.readouterr().out
    assert "float32/adaptive/backward" in out and "shape and dtype only" in out


def test_harness_cli_picks_configurations(tmp_path):
    path = tmp_path / "coverage.json"
    argv = ["--ops", "add", "--samples", "1", "--dtypes", "bfloat16", "--modes", "adaptive", "--no-backward",
            "--json", str(path)]
    assert op_coverage.main(argv) == 0
    result = json.loads(path.read_text())
    assert list(result["summary"]["configs"]) == ["bfloat16/adaptive/forward"]
    argv = ["--ops", "add", "--samples", "1", "--no-forward", "--modes", "strict", "--json", str(path)]
    assert op_coverage.main(argv) == 0
    assert list(json.loads(path.read_text())["summary"]["configs"]) == ["float32/strict/backward"]


def test_harness_exit_status_says_whether_everything_passed(tmp_path, capsys):
    """An op that fails (a CSR sample, which the device refuses) makes the sweep exit 1."""
    path = tmp_path / "coverage.json"
    argv = ["--ops", "sparse.mm.reduce", "--samples", "1", "--dtypes", "float32", "--no-backward", "--modes", "strict",
            "--json", str(path)]
    assert op_coverage.main(argv) == 1
    assert json.loads(path.read_text())["summary"]["configs"]["float32/strict/forward"]["fail"] == 1
    assert "exit status 1" in capsys.readouterr().err


def test_native_warnings_are_counted_not_printed(capfd):
    """PyTorch kernels' C++ warnings on the device's worker thread ([W... Warning: ...],
    straight to stderr) are counted; other stderr output passes through."""
    import torch

    with op_coverage._native_warnings_counted() as warned:
        torch.std(torch.ones(1, device="neuron"), correction=1).cpu()  # degrees of freedom <= 0
        os.write(2, b"something else\n")
    err = capfd.readouterr().err
    assert warned and "degrees of freedom" in warned[0] and "Warning:" not in err
    assert "something else" in err
