"""OpInfo coverage, fast subset: commonly used ops must match CPU on ``neuron``.

The full sweep over PyTorch's whole ``op_db`` is ``python bench/op_coverage.py``; this
runs the same harness (``bench/op_coverage.py``) on a representative set, one test per op
so each failure is reported on its own. ``pass_fallback`` (correct, but some aten op ran on
the CPU fallback) is accepted here; the sweep reports it.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

SAMPLES = 4


@pytest.fixture(scope="module")
def opinfos():
    return {op_coverage.op_key(opinfo): opinfo for opinfo in op_coverage.load_op_db()}


@pytest.mark.parametrize("key", COMMON_OPS)
def test_common_op_matches_cpu(key, opinfos):
    assert key in opinfos, f"{key} is not in op_db any more: update COMMON_OPS"
    record = op_coverage.run_opinfo(opinfos[key], max_samples=SAMPLES)
    assert record["outcome"] in ("pass", "pass_fallback"), (
        f"{key}: {record['outcome']}: {record['reason']}; "
        f"sample #{record.get('failing_sample_index')}: {record.get('failing_sample')}"
    )
    assert record["samples_compared"] > 0


def test_harness_reports_a_device_failure(opinfos):
    """A kernel failing on the device (fault injection) is a ``fail`` naming the op."""
    from adaptive_eager.device.queue import QUEUE, FaultInjector

    QUEUE.faults = FaultInjector("aten::mul:1")  # conftest resets it
    record = op_coverage.run_opinfo(opinfos["mul"], max_samples=1)
    assert record["outcome"] == "fail"
    assert record["reason"].startswith("NeuronRuntimeError: aten::mul"), record["reason"]
    assert "injected fault" in record["reason"]


def test_harness_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "coverage.json"
    assert op_coverage.main(["--ops", "add,nn.functional.dropout", "--samples", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert set(result) == {"summary", "ops"}
    assert set(result["ops"]) == {"add", "nn.functional.dropout"}
    for record in result["ops"].values():
        assert {"outcome", "reason", "fallback_ops"} <= set(record)
    assert result["ops"]["nn.functional.dropout"]["compare"] == "shape_dtype"
    summary = result["summary"]
    assert summary["pass"] + summary["pass_fallback"] + summary["fail"] + summary["skip"] == 2
    out = capsys.readouterr().out
    assert "pass" in out and "shape and dtype only" in out
