"""Fixtures shared by the compiled-mode tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tiny_static_llama():
    """transformers' Llama, tiny, on the CPU: (model, prompt ids, the CPU's greedy static-cache
    generation of 6 new tokens)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 6))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    return model, ids, expected
