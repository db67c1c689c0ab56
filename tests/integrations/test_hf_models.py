"""A fast subset of the Hugging Face sweep (bench/hf_models.py) in the default test run.

Five causal-LM architectures, each built tiny offline with the sweep's own code: Llama
(rotary decoder), GPT-2 (learned positions, tied embeddings), BERT's LM head
(``BertLMHeadModel``: a BERT-style decoder, tied embeddings), and two mixtures of experts:
Mixtral (transformers' shared grouped_mm experts path, used by most MoE models) and
JetMoE (its own experts and a mixture of attention heads). Each runs
forward with loss, backward, one AdamW step and greedy generate on ``neuron`` in adaptive
eager, and must match the CPU: loss, logits, every gradient and the AdamW step within
the sweep's fp32 tolerances, and the same generated tokens.

Any failure fails the test. Skipped when ``transformers`` is not installed (``pip install
-e ".[hf]"``; CI installs it).
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import hf_models  # noqa: E402

SUBSET = ["llama", "gpt2", "bert", "mixtral", "jetmoe"]


@pytest.fixture(scope="module", autouse=True)
def offline():
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(verbosity)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("model_type", SUBSET)
def test_architecture_matches_cpu(model_type, adaptive_mode):
    record = hf_models.run_architecture(model_type, strict=False)
    assert record["status"] != "not_buildable", f"the tiny model no longer builds: {record.get('error')}"
    assert record["status"] == "ok", f"{record.get('stage')}: {record.get('error')}"
    assert record["generate"]["equal"], record["generate"]
    assert record["launches"]["adaptive"] > 0


def test_tiny_configs_are_tiny():
    """The shrinking reaches the sizes the sweep promises, through per-architecture field names."""
    for model_type in ("llama", "gpt2", "bert", "mixtral", "deepseek_v3", "mamba2"):
        config = hf_models.tiny_config(model_type)
        text = config.get_text_config()
        assert text.vocab_size == hf_models.VOCAB, model_type
        assert getattr(text, "num_hidden_layers") <= hf_models.LAYERS, model_type
        assert getattr(text, "hidden_size") == hf_models.HIDDEN, model_type


def test_unbuildable_is_listed_with_its_reason():
    """An architecture that cannot be built tiny offline is recorded, with the reason, not dropped."""
    import importlib.util

    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed: gemma3n's vision tower builds")
    record = hf_models.run_architecture("gemma3n", strict=False)
    assert record["status"] == "not_buildable"
    assert record["stage"] == "build" and "timm" in record["error"]


def test_compare_catches_mismatches():
    import torch

    cpu = {"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3), "grads": {"w": torch.ones(2)},
           "params": {"w": torch.ones(2)}, "generated": torch.tensor([[1, 2, 3]]), "prompt_length": 1,
           "scores": [torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.0, 1.0, 5.0]])]}
    same = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cpu.items()}
    diffs, problems, generate = hf_models.compare(same, cpu, replayed={"w": torch.ones(2)})
    assert problems == [] and generate["equal"]

    wrong = dict(same, loss=torch.tensor(1.1), grads={}, generated=torch.tensor([[1, 2, 4]]))
    _, problems, generate = hf_models.compare(wrong, cpu)
    text = "; ".join(problems)
    assert "loss differs" in text and "exist on one device only" in text and "generated tokens differ" in text
    assert generate["first_position"] == 2 and generate["near_tie"] is False
