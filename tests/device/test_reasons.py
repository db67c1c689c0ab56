"""Flush, sync and refusal reasons come from one table (device/core/reasons.py), and every
reason the runtime produces has an explanation in it."""
from __future__ import annotations

import ast
import pathlib

import torch

import adaptive_eager
from adaptive_eager_device.core.reasons import Flush, Refused, explain

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCERS = {"flush", "synchronize", "_synchronize", "run_on_host"}


def _reason_argument(call: ast.Call):
    name = getattr(call.func, "attr", None) or getattr(call.func, "id", None)
    if name not in PRODUCERS:
        return None
    if name == "run_on_host":
        return call.args[3] if len(call.args) > 3 else None
    return call.args[0] if call.args else None


def test_no_producer_passes_a_reason_of_its_own():
    """A sync point, flush or host run names its reason by a Flush member, never by a
    string literal: a literal would count in the statistics with no explanation."""
    offenders = []
    for folder in ("device", "adaptive_eager", "fusion"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    argument = _reason_argument(node)
                    if isinstance(argument, (ast.Constant, ast.JoinedStr)):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_planner_gives_refusals_by_member():
    """No refusal text is spelled out in fusion/: each comes from a Refused member."""
    offenders = []
    for path in sorted((ROOT / "fusion").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                first = node.values[0] if node.values else None
                text = first.value if isinstance(first, ast.Constant) else ""
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            else:
                continue
            if any(text == m.value or text.startswith((m.value + ":", m.value + " ")) for m in Refused):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert offenders == []


def test_every_reason_is_explained():
    for member in [*Flush, *Refused]:
        assert member.why and explain(member) == member.why
        assert explain(member.of("aten::mul")) == member.why  # with the op it concerns
    assert explain("two anchors: reduction and matmul") == Refused.TWO_ANCHORS.why
    assert explain("no such reason") == ""


def test_a_copy_to_the_host_is_not_called_a_host_read(any_mode):
    """`.cpu()` is a copy to the host, `.item()` a host read: each counts and explains as
    itself (the stats CLI once called `.cpu()` a host read)."""
    adaptive_eager.reset_stats()
    x = torch.ones(4, device="neuron") * 2
    x.cpu()
    x.sum().item()
    sync_points = adaptive_eager.stats()["sync_points"]
    assert sync_points["copy_to_host"] == 1 and sync_points["host_read"] == 1
    assert ".cpu()" in explain("copy_to_host") and ".item()" in explain("host_read")
    assert all(type(reason) is str for reason in sync_points)  # plain strings in the dump


def test_the_reasons_a_program_produces_are_all_explained(any_mode):
    adaptive_eager.reset_stats()
    x = torch.randn(64, 64, device="neuron")
    y = (x @ x).relu().sum(0)
    torch.nonzero(y > 0)  # data-dependent
    torch.neuron.manual_seed(0)  # the generator's state
    stream = torch.neuron.Stream()
    with torch.neuron.stream(stream):
        (x * 2).sum()
    stream.query()
    torch.neuron.Event().record()
    x.resize_(32, 32)
    y.tolist()
    data = adaptive_eager.stats()
    reasons = [*data["flushes"]["by_reason"], *data["sync_points"], *data["refusals"]]
    assert len(set(reasons)) >= 3
    assert [reason for reason in reasons if not explain(reason)] == []
