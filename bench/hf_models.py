"""Hugging Face causal-LM architectures on the ``neuron`` device (adaptive eager) vs CPU.

For every architecture in ``transformers``' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:

1. **build** a tiny model offline: the architecture's config class with its size fields
   shrunk (hidden 64, 2 layers, 4 heads, 2 KV heads, vocabulary 256, 4 experts ...;
   :func:`tiny_config`), special token ids moved into the small vocabulary, dropout
   off, random init under ``torch.manual_seed(0)``, ``eval()`` mode. No hub access
   (``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``).
2. **CPU reference**: forward with ``labels=input_ids`` (the loss), backward, one
   ``AdamW`` step, then greedy ``generate(max_new_tokens=8, do_sample=False)``.
3. **neuron, adaptive eager**: the same pipeline on a copy of the same initial weights
   moved with ``.to('neuron')``, with a sync point after each stage so that a deferred
   device error is charged to the stage that caused it.
4. **compare** with the CPU: loss, logits, every gradient (max absolute difference within
   :data:`TOLERANCES`), the AdamW step (against the CPU's AdamW applied to the neuron
   gradients), the updated parameters (reported; see :data:`TOLERANCES`) and the
   generated tokens (equal, unless the CPU itself had a top-2 tie at the first
   difference).
5. **strict eager**: forward + backward once more in strict mode, to compare kernel
   launches (``adaptive_eager.stats()["kernels_launched"]``) with adaptive mode's.

Outcome of each architecture:

- ``ok``: every neuron stage ran and every comparison is within tolerance;
- ``fail``: a neuron stage raised or timed out (``stage`` and a one-line ``error``), or
  a result differs from the CPU (``stage="compare"``);
- ``not_buildable``: the tiny model cannot be built or run *on the CPU* offline (the
  error says why, plus a ``note`` where it needs explaining: an extra package, a model
  that cannot run standalone...). These are listed apart and count in the denominator
  of the "of all architectures" figure; the headline figure is ``ok / (ok + fail)``.

Per-architecture config fixes (:data:`EXTRA`, :data:`CALL_KWARGS`, ...) each say why;
several work around transformers bugs that the default config hits too.

Each architecture runs in its own subprocess with a time limit, so a crash or a hang
costs one entry, not the sweep. The JSON records the commit and any uncommitted files of
``device/``, ``fusion/`` and ``adaptive_eager/`` at the time of the run.

Usage::

    python -m bench.hf_models [--only llama,gpt2] [--limit N] [--jobs 2] [--timeout 300]
                              [--json PATH]

Prints the table, the % that work out of the box, the failures grouped by error, and
writes ``bench/results/latest/hf_models.json`` (``bench/results/hf_models.json`` with
``--save``; ``--only``/``--limit`` runs write nowhere unless ``--json`` is given). Exit
status 1 when any buildable architecture fails.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/hf_models.py`
    sys.path.insert(0, ROOT)
from bench import SAVE_HELP, provenance, results_path  # noqa: E402
DEFAULT_JSON = os.path.join(ROOT, "bench", "results", "hf_models.json")
DEFAULT_TIMEOUT_S = 300.0

SEED = 0
BATCH, SEQ = 2, 8
NEW_TOKENS = 8
LR = 1e-3
VOCAB = 256
# Input ids are drawn from [FIRST_ID, LAST_ID): clear of pad/bos/eos (0, 1, 2) and of the
# other special tokens (image, audio, ...), which are moved to the top of the vocabulary.
FIRST_ID, LAST_ID = 4, 200

# Tolerances (fp32). A quantity passes when max|neuron - cpu| <= atol + rtol * max|cpu|
# (per tensor). AdamW's first step is ~ lr * g / (|g| + eps): an element whose gradient is
# ~eps turns 1e-12 of gradient noise into ~1e-5 of update, so the updated parameters are
# compared with the CPU for the record only, and the step itself is checked against the
# CPU's AdamW applied to the neuron gradients.
TOLERANCES = {
    "loss": (1e-5, 1e-4),
    "logits": (1e-5, 1e-4),
    "grads": (1e-5, 1e-4),
    "params": (LR / 10, 0.0),  # reported only (see compare)
    "step": (1e-6, 1e-5),  # neuron's AdamW step vs the CPU's AdamW on the neuron gradients
}

# -- tiny configs ------------------------------------------------------------------------
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16
FFN, MOE_FFN, EXPERTS, TOP_K = 128, 32, 4, 2

# Size fields by name, across architectures (only fields a config class declares are set).
TINY = {
    # width
    **dict.fromkeys(
        ["hidden_size", "n_embd", "d_model", "embedding_dim", "emb_dim", "word_embed_proj_dim", "lru_width",
         "backbone_hidden_size", "output_embedding_size", "hidden_size_global"], HIDDEN),
    **dict.fromkeys(["embedding_size", "input_embedding_size", "pronunciation_embed_dim", "shape_embed_dim",
                     "hidden_size_per_layer_input", "ple_embed_dim", "router_hidden_size"], 32),
    # depth
    **dict.fromkeys(
        ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
         "num_encoder_layers", "num_decoder_layers", "num_blocks"], LAYERS),
    # heads
    **dict.fromkeys(
        ["num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
         "encoder_attention_heads", "attention_heads", "num_encoder_attention_heads",
         "num_decoder_attention_heads", "swa_num_attention_heads"], HEADS),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "multi_query_group_num"], KV_HEADS),
    **dict.fromkeys(["head_dim", "d_head", "attention_head_size", "dim_head", "kv_channels", "swa_head_dim",
                     "global_head_dim"], HEAD_DIM),
    # feed-forward
    **dict.fromkeys(
        ["intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
         "feed_forward_size", "d_inner", "dim_ff", "dff", "intermediate_size_mlp", "dense_intermediate_size"], FFN),
    **dict.fromkeys(
        ["moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
         "shared_experts_intermediate_size", "expert_ffn_hidden_size", "moe_shared_expert_intermediate_size",
         "expert_intermediate_size"], MOE_FFN),
    # mixture of experts
    **dict.fromkeys(["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"], EXPERTS),
    **dict.fromkeys(["num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"], TOP_K),
    **dict.fromkeys(["n_group", "topk_group", "num_expert_group"], 1),
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE
    "zero_expert_num": 2,
    # multi-head latent attention (DeepSeek-style) and sparse indexers
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16,
    "v_head_dim": 16, "o_lora_rank": 16, "o_groups": 2,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4, "index_block_size": 4, "index_topk_blocks": 2,
    # linear attention / state-space layers
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_chunk_size": 8, "chunk_size": 8,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "state_size": 16, "mamba_dt_rank": 8,
    "time_step_rank": 8, "n_groups": 1, "mamba_headdim": 16, "n_mamba_heads": 2, "mamba_d_ssm": 128,
    "adapter_rank": 8,
    # positions and windows
    **dict.fromkeys(
        ["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length", "max_target_positions",
         "original_max_position_embeddings", "model_max_length", "max_inference_chunksize"], 128),
    **dict.fromkeys(
        ["sliding_window", "sliding_window_size", "window_size", "attention_window_size", "local_attention_window_len",
         "keep_window_size", "local_attention"], 8),
    "rotary_dim": 8,
    # vocabularies
    **dict.fromkeys(["vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "unpadded_vocab_size"], VOCAB),
    "pronunciation_vocab_size": 64, "shape_vocab_size": 64, "encoder_hash_byte_group_vocab": 512,
    # odds and ends, per family
    "laurel_rank": 8, "hc_lowrank": 16, "gated_norm_rank": 8, "loop_gate_rank": 8, "d_rel": 8,
    "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "adapter_in_dim": HIDDEN,
    "adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN, "downsample_hidden_size": 32,
    "moe_layer_end_index": LAYERS - 1, "max_window_layers": LAYERS,
}
# A field whose class default is None is set too, unless None means "off" or "derive it
# from other fields in a way a fixed value would contradict".
KEEP_NONE = {"sliding_window", "window_size", "local_attention", "attention_hidden_size", "attention_head_dim",
             "original_max_position_embeddings", "rotary_dim", "max_window_layers", "model_max_length",
             "moe_layer_end_index"}
# Fields that are counts to cap, not sizes to set (keep a smaller default).
CAP = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "n_group", "topk_group",
       "num_expert_group", "first_k_dense_replace", "sliding_window", "window_size", "local_attention"}
# Fields that give the number of layers, and the names of per-layer pattern fields (a list,
# or a string of one letter per layer, as long as the default number of layers).
LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
PATTERN_FIELD = re.compile(r"layer|pattern|block_type|types")

# Per-architecture additions, applied after the generic shrinking (a nested dict applies
# to the sub-config of that name). Each says why.
EXTRA: dict[str, dict] = {
    # a layer pattern given as "period/offset", not as a per-layer list: keep one of each kind
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # the default layer pattern (None) is derived as all linear-attention: keep one attention layer
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # three stacks of one layer each
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # the default pattern has one layer of each kind: mamba, MoE, attention, MLP
    "nemotron_h": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},
    # HRM rewrites num_hidden_layers as layers-per-stack x cycles: one layer per stack
    "hrm_text": {"num_hidden_layers": 1},
    # the default config leaves the sparse indexer's sizes None and the model divides them
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                       "indexer_budget": 8, "indexer_compress_ratio": 2},
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                                  "indexer_budget": 8, "indexer_compress_ratio": 2}},
    # the default layer pattern is None and the model indexes it
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # Reformer: axial position factors must sum to the hidden size and, in training, multiply
    # to the sequence length (SEQ_OVERRIDE); small chunks. In train() mode it reseeds from
    # torch.seed() (non-deterministic, even CPU vs CPU), so the LSH hashing gets a fixed seed.
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32],
                 "hash_seed": 0,
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_buckets": 2,
                 "attention_head_size": HEAD_DIM},
    # Mamba-2: num_heads * head_dim must equal expand * hidden_size
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # Gemma-3n: KV sharing across the last 15 layers does not fit 2 layers
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # GIT slices the image-token positions off the logits even without an image: a
    # 32x32 image of 16x16 patches keeps that to 5 positions
    "git": {"vision_config": {"image_size": 32, "patch_size": 16}},
    # Zamba shares one transformer block between its hybrid layers: it needs two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attn_layer_period": 2, "attn_layer_offset": 1},
    # RWKV's attention width is its hidden size
    "rwkv": {"rescale_every": 0, "attention_hidden_size": HIDDEN},
    # xLSTM rounds qk_dim = hidden * 0.5 up to a multiple of 64 in one place and not in another
    "xlstm": {"hidden_size": 2 * HIDDEN, "embedding_dim": 2 * HIDDEN},
    # transformers 5.24 bugs that the default config hits too, worked around with the field the
    # model reads: DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no
    # longer declares, and clamps with clip_qkv, whose default None makes clamp() raise
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # CohereCompass reads rope_parameters[layer_type]; the default is {}
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the drafter's validator wants these text-config values, and its default config fails
    # it, so its text config is shrunk here
    "gemma4_assistant": {"text_config": lambda: {
        **tiny_overrides("gemma4_text"), "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": LAYERS, "enable_moe_block": False, "use_double_wide_mlp": False}},
}

# Per-architecture hooks run on the built model (CPU, before the runs).
def _xmod_language(model):
    model.set_default_language(model.config.languages[0])


POST_BUILD = {"xmod": _xmod_language}

# Per-architecture input tweaks: training sequence length (generate always starts from
# the first SEQ tokens); models that train only in train() mode (dropout is 0 anyway):
# Reformer asserts it, RWKV writes its recurrent state in place when the cache is on
# (the eval-mode default); extra keyword arguments of forward() and generate().
SEQ_OVERRIDE: dict[str, int] = {"reformer": 16}
TRAIN_MODE = {"reformer", "rwkv"}
CALL_KWARGS: dict[str, dict] = {
    # Reformer's cached generation fails in transformers 5.24 (einsum over a 5-d tensor)
    "reformer": {"generate": {"use_cache": False}},
    # xLSTM's cache (on by default) is written in place: no backward through it
    "xlstm": {"forward": {"use_cache": False}},
    # BLT builds DynamicCache(config=BltConfig), which has no num_hidden_layers (5.24)
    "blt": {"forward": {"use_cache": False}, "generate": {"use_cache": False}},
    # MusicGen pads codebooks with the decoder start token, which a checkpoint's
    # generation config sets and a bare decoder config lacks; its own generate() passes
    # num_return_sequences (None by default in 5.24) to repeat_interleave
    "musicgen": {"generate": {"decoder_start_token_id": 0, "num_return_sequences": 1}},
    "musicgen_melody": {"generate": {"decoder_start_token_id": 0, "num_return_sequences": 1}},
}
# Architectures that cannot run standalone whatever the config; the error stays recorded,
# this note says why.
NOTES = {
    "gemma4_assistant": "a speculative-decoding drafter: its forward needs the target model's shared KV states",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward needs the target model's shared KV states",
}


def _fields(cls) -> dict:
    """Declared dataclass fields of a config class -> class default (``...`` for factories)."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default if f.default is not dataclasses.MISSING else ...
    return out


def _special_token_field(name: str) -> bool:
    return name.endswith(("_token_id", "_token_index", "_token_ids")) or name in ("image_token_id", "video_token_id")


def _get(instance, name, default):
    if instance is None:
        return default
    try:
        return getattr(instance, name)
    except Exception:  # per-layer attributes (AmbiguousGlobalPerLayerAttributeError) and the like
        return instance.__dict__.get(name, default)


def _shrink(cls, instance, depth=0) -> dict:
    """Overrides that make config class ``cls`` tiny. ``instance`` is its default
    instance (to find the sub-configs it builds, its per-layer patterns and the special
    token ids it uses)."""
    from transformers import PreTrainedConfig

    fields = _fields(cls)
    overrides: dict = {}
    next_special = [VOCAB - 1]

    def special():
        value = next_special[0]
        next_special[0] -= 1
        return value

    default_layers = None
    for name in LAYER_COUNT_FIELDS:
        value = _get(instance, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > LAYERS:
            default_layers = value
            break

    for name, default in fields.items():
        current = _get(instance, name, default)
        if isinstance(current, PreTrainedConfig) and depth < 3:
            sub = _shrink(type(current), current, depth + 1)
            # keep what the composite's defaults set beyond the declared fields (rope_theta...)
            sub_fields = _fields(type(current))
            # (per_layer_config is derived from layer_types again when the sub-config is built)
            extras = {k: v for k, v in current.to_dict().items()
                      if k not in sub_fields and k != "per_layer_config"}
            extras.update({k: TINY[k] for k, v in extras.items()
                           if k in TINY and isinstance(v, int) and not isinstance(v, bool)})
            overrides[name] = {**extras, **sub, "model_type": current.model_type}
            continue
        if name in TINY:
            if current is None and (default is not None or name in KEEP_NONE):
                continue
            if isinstance(current, bool) or (current is not None and not isinstance(current, int)):
                continue
            value = TINY[name]
            if name in CAP and isinstance(current, int):
                value = min(value, current)
            overrides[name] = value
        elif (default_layers and isinstance(current, (list, tuple, str)) and len(current) == default_layers
              and PATTERN_FIELD.search(name)):
            # a per-layer pattern: layer 0, and the first layer of another kind
            other = next((i for i, v in enumerate(current) if v != current[0]), 1)
            picked = [current[0], current[other]]
            overrides[name] = "".join(picked) if isinstance(current, str) else picked
        elif (default_layers and isinstance(current, dict) and current
              and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in current)):
            # per-layer settings keyed by layer index: keep those of the first layers, or
            # move the first entry onto the last layer
            kept = {k: v for k, v in current.items() if int(k) < LAYERS}
            if not kept:
                first = next(iter(current))
                kept = {type(first)(LAYERS - 1): current[first]}
            overrides[name] = kept
        elif "dropout" in name or name.endswith("pdrop") or name.endswith("_drop"):
            if isinstance(current, float) and current > 0:
                overrides[name] = 0.0
        elif _special_token_field(name):
            if name == "pad_token_id":
                overrides[name] = 0 if current is not None else None
            elif name in ("bos_token_id", "decoder_start_token_id"):
                overrides[name] = 1 if current is not None else None
            elif name in ("eos_token_id", "forced_eos_token_id"):
                overrides[name] = 2 if current is not None else None
            elif isinstance(current, int) and not isinstance(current, bool):
                overrides[name] = special() if current >= 3 else current
            elif isinstance(current, list) and current and all(isinstance(v, int) for v in current):
                overrides[name] = [special() for _ in current]
    # multi-head latent attention: the rotary part is head_dim wide; as many KV heads as heads
    if "qk_rope_head_dim" in overrides and "head_dim" in fields:
        overrides["head_dim"] = overrides["qk_rope_head_dim"]
    if "kv_lora_rank" in overrides and "num_key_value_heads" in fields:
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", HEADS)
    if "is_decoder" in fields:
        overrides["is_decoder"] = True
    return overrides


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_config(model_type: str):
    """The architecture's config class, shrunk (see :data:`TINY`, :data:`EXTRA`)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception:  # a default that does not validate: shrink the declared fields only
        default = None
    overrides = _merge(_shrink(cls, default), _resolve(EXTRA.get(model_type, {})))
    return cls(**overrides)


def tiny_overrides(model_type: str) -> dict:
    """The shrinking overrides of one config class, as a sub-config dict."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return {**_shrink(cls, cls()), "model_type": model_type}


def _resolve(value):
    if callable(value):
        return value()
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    return value


@dataclasses.dataclass
class Case:
    """What one architecture runs: forward kwargs (with ``labels``), generate kwargs
    (the prompt), and whether forward/backward run in train() mode."""

    forward: dict
    generate: dict
    train_mode: bool = False
    generate_kwargs: dict = dataclasses.field(default_factory=dict)


def _musicgen_inputs(config, ids):
    # input_ids are (batch * num_codebooks, seq); labels are (batch, seq, num_codebooks)
    k = config.num_codebooks
    codes = ids.repeat_interleave(k, dim=0)
    labels = codes.reshape(BATCH, k, -1).transpose(1, 2)
    return {"input_ids": codes, "labels": labels}, {"input_ids": codes[:, :SEQ]}


def _git_inputs(config, ids):
    # an image of the (tiny) vision tower's size: GIT's loss assumes its tokens come first
    import torch

    vision = config.vision_config
    generator = torch.Generator().manual_seed(SEED + 1)
    pixels = torch.randn(BATCH, vision.num_channels, vision.image_size, vision.image_size, generator=generator)
    return ({"input_ids": ids, "labels": ids, "pixel_values": pixels},
            {"input_ids": ids[:, :SEQ], "pixel_values": pixels})


INPUTS = {"musicgen": _musicgen_inputs, "musicgen_melody": _musicgen_inputs, "git": _git_inputs}


def make_case(model_type: str, config) -> Case:
    import torch

    generator = torch.Generator().manual_seed(SEED)
    seq = SEQ_OVERRIDE.get(model_type, SEQ)
    vocab = getattr(config.get_text_config(), "vocab_size", VOCAB) or VOCAB
    ids = torch.randint(FIRST_ID, min(LAST_ID, vocab), (BATCH, seq), generator=generator)
    if model_type in INPUTS:
        forward, generate = INPUTS[model_type](config, ids)
    else:
        forward, generate = {"input_ids": ids, "labels": ids}, {"input_ids": ids[:, :SEQ]}
    extra = CALL_KWARGS.get(model_type, {})
    return Case({**forward, **extra.get("forward", {})}, generate, model_type in TRAIN_MODE, extra.get("generate", {}))


def build(model_type: str):
    """(model in eval mode on the CPU, config, :class:`Case`): seed 0, random init."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    expected = getattr(model_class, "config_class", None)
    if expected is not None and not isinstance(config, expected):
        # e.g. musicgen: the mapping names the decoder-only class for the composite config
        for value in vars(config).values():
            if isinstance(value, expected):
                config = value
                break
    torch.manual_seed(SEED)
    model = model_class._from_config(config, dtype=torch.float32)
    if model_type in POST_BUILD:
        POST_BUILD[model_type](model)
    model.float().eval()
    return model, config, make_case(model_type, config)


# -- one run of the pipeline -------------------------------------------------------------
class StageError(Exception):
    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"{stage}: {error}")
        self.stage, self.error = stage, error


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _sync(device) -> None:
    if device.type == "neuron":
        import adaptive_eager

        adaptive_eager.synchronize()


def run_pipeline(model, case: Case, device, progress=lambda stage: None, fwd_bwd_only: bool = False) -> dict:
    """Forward with loss, backward, AdamW step, greedy generate, on ``device``. Returns
    CPU copies of everything compared, plus launch counts when on ``neuron``."""
    import torch

    import adaptive_eager

    on_neuron = device.type == "neuron"
    out: dict = {}
    stage = "to_device"

    def enter(name):
        nonlocal stage
        stage = name
        progress(name)

    def move(kwargs):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    try:
        enter("to_device")
        torch.manual_seed(SEED)
        model = model.to(device)
        forward = move(case.forward)
        prompt = move(case.generate)
        mask = _accepts(model, "attention_mask")
        if mask:
            forward.setdefault("attention_mask", torch.ones_like(forward["input_ids"]))
            prompt.setdefault("attention_mask", torch.ones_like(prompt["input_ids"]))
        _sync(device)
        before = adaptive_eager.stats() if on_neuron else None

        enter("forward")
        if case.train_mode:
            model.train()
        result = model(**forward)
        loss = result.loss
        if loss is None:
            raise RuntimeError("the model returned no loss for labels=input_ids")
        _sync(device)
        enter("backward")
        loss.backward()
        _sync(device)
        if on_neuron:
            s = adaptive_eager.stats()
            out["launches_fwd_bwd"] = s["kernels_launched"] - before["kernels_launched"]
            out["ops_fwd_bwd"] = s["ops_recorded"] - before["ops_recorded"]
            out["patterns_fwd_bwd"] = {
                name: counts["matched"] - before["patterns"].get(name, {}).get("matched", 0)
                for name, counts in s["patterns"].items()
                if counts["matched"] > before["patterns"].get(name, {}).get("matched", 0)
            }
        model.eval()
        out["loss"] = loss.detach().cpu()
        logits = result.logits
        out["logits"] = logits.detach().cpu() if isinstance(logits, torch.Tensor) else None
        out["grads"] = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
        if fwd_bwd_only:
            return out

        enter("optimizer_step")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        out["params"] = {n: p.detach().cpu() for n, p in model.named_parameters()}

        enter("generate")
        gen_kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                          output_scores=True, return_dict_in_generate=True, **case.generate_kwargs)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None and generation_config.pad_token_id is None and "pad_token_id" not in gen_kwargs:
            eos = generation_config.eos_token_id
            gen_kwargs["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        with torch.no_grad():
            generated = model.generate(**prompt, **gen_kwargs)
        _sync(device)
        sequences = generated.sequences if hasattr(generated, "sequences") else generated
        out["generated"] = sequences.cpu()
        out["prompt_length"] = prompt["input_ids"].shape[-1]
        out["scores"] = [s.detach().cpu() for s in (getattr(generated, "scores", None) or ())]
    except BaseException as error:  # noqa: BLE001 - every failure becomes a record
        if isinstance(error, KeyboardInterrupt):
            raise
        raise StageError(stage, error) from error
    return out


# -- comparison ---------------------------------------------------------------------------
def _maxdiff(a, b) -> tuple[float, float]:
    """(max |a - b|, max |b|) in float64, NaNs equal to NaNs, inf where shapes differ."""
    import torch

    if a.shape != b.shape:
        return float("inf"), 0.0
    a, b = a.double(), b.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    ref = torch.nan_to_num(b.abs(), nan=0.0, posinf=0.0)
    return (float(diff.max()) if diff.numel() else 0.0), (float(ref.max()) if ref.numel() else 0.0)


def replay_step(pristine, grads: dict) -> dict:
    """The CPU's AdamW step from the initial weights with the given gradients: what the
    neuron step must produce from the neuron gradients."""
    import torch

    model = copy.deepcopy(pristine)
    for name, param in model.named_parameters():
        param.grad = grads[name].clone() if name in grads else None
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    return {n: p.detach() for n, p in model.named_parameters()}


def compare(neuron: dict, cpu: dict, replayed: dict | None = None) -> tuple[dict, list[str], dict]:
    """(max diffs, mismatches, generate details). ``replayed`` is :func:`replay_step` of
    the neuron gradients: the optimizer step is checked against it, exactly; the updated
    parameters against the CPU's are reported (``params``) but not checked, since
    AdamW's first step, ~lr * g / (|g| + eps), amplifies fp noise in gradients near eps."""
    diffs, problems = {}, []

    def check(name, a, b, kind=None):
        d, ref = _maxdiff(a, b)
        atol, rtol = TOLERANCES[kind or name]
        diffs[name] = max(diffs.get(name, 0.0), d)
        return d <= atol + rtol * ref, d

    if neuron.get("logits") is not None and cpu.get("logits") is not None:
        ok, d = check("logits", neuron["logits"], cpu["logits"])
        if not ok:
            problems.append(f"logits differ by {d:.3g}")
    ok, d = check("loss", neuron["loss"], cpu["loss"])
    if not ok:
        problems.append(f"loss differs by {d:.3g} (cpu {float(cpu['loss']):.6g}, neuron {float(neuron['loss']):.6g})")
    sections = [("grads", neuron.get("grads", {}), cpu.get("grads", {}), True),
                ("params", neuron.get("params", {}), cpu.get("params", {}), False)]
    if replayed is not None:
        sections.append(("step", neuron.get("params", {}), replayed, True))
    for section, a, b, checked in sections:
        if set(a) != set(b):
            missing = sorted(set(b) ^ set(a))
            if section != "step":
                problems.append(f"{section}: parameters {', '.join(missing[:3])} exist on one device only")
        worst = None
        for name in sorted(set(a) & set(b)):
            ok, d = check(section, a[name], b[name])
            if checked and not ok and (worst is None or d > worst[1]):
                worst = (name, d)
        if worst:
            problems.append(f"{section} differ: {worst[0]} by {worst[1]:.3g}")
    generate = {}
    if "generated" in neuron and "generated" in cpu:
        a, b = neuron["generated"], cpu["generated"]
        generate["equal"] = bool(a.shape == b.shape and bool((a == b).all()))
        prompt = cpu.get("prompt_length", 0)
        scores_a, scores_b = neuron.get("scores", []), cpu.get("scores", [])
        first = None
        if a.shape[0] == b.shape[0]:
            n = min(a.shape[1], b.shape[1])
            unequal = (a[:, :n] != b[:, :n]).any(0).nonzero()
            first = int(unequal[0]) if unequal.numel() else (None if a.shape == b.shape else n)
        # the scores agree up to (and including) the first differing step
        steps = len(scores_b) if first is None else max(0, first - prompt + 1)
        score_diff = 0.0
        for sa, sb in zip(scores_a[:steps], scores_b[:steps]):
            d = _finite_maxdiff(sa, sb)
            if d is not None:
                score_diff = max(score_diff, d)
        generate["score_diff"] = score_diff
        if not generate["equal"]:
            generate["first_position"] = first
            step = None if first is None else first - prompt
            if step is not None and 0 <= step < len(scores_b):
                top = scores_b[step].float().topk(2, dim=-1).values
                margin = float((top[:, 0] - top[:, 1]).min())
                generate["cpu_top2_margin"] = margin
                # a tie: the CPU's own top-2 margin is within the scores' fp difference
                generate["near_tie"] = margin <= max(10 * score_diff, 1e-5)
            if not generate.get("near_tie"):
                problems.append(f"generated tokens differ from position {first}: "
                                f"neuron {a[0].tolist()} cpu {b[0].tolist()}")
    return diffs, problems, generate


def _finite_maxdiff(a, b):
    import torch

    if a.shape != b.shape:
        return None
    mask = torch.isfinite(a) & torch.isfinite(b)
    if not bool(mask.any()):
        return 0.0
    return float((a.double() - b.double()).abs()[mask].max())


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text[:400]


# -- the worker: one architecture, in this process ----------------------------------------
def run_architecture(model_type: str, progress=lambda stage: None, strict: bool = True) -> dict:
    import torch
    import transformers  # noqa: F401

    import adaptive_eager
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    record: dict = {"model_type": model_type, "model_class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)}
    if model_type in NOTES:
        record["note"] = NOTES[model_type]
    started = time.perf_counter()

    # 1. build, on the CPU
    progress("build")
    try:
        model, config, case = build(model_type)
    except BaseException as error:  # noqa: BLE001
        record.update(status="not_buildable", stage="build", error=_one_line(error))
        return record
    record["params"] = sum(p.numel() for p in model.parameters())
    record["input_shape"] = list(case.forward["input_ids"].shape)
    pristine = copy.deepcopy(model)

    # 2. the CPU reference
    try:
        cpu = run_pipeline(model, case, torch.device("cpu"), lambda s: progress("cpu:" + s))
    except StageError as failure:
        record.update(status="not_buildable", stage="cpu:" + failure.stage, error=_one_line(failure.error))
        return record
    record["cpu_seconds"] = round(time.perf_counter() - started, 2)

    # 3. neuron, adaptive eager
    adaptive_eager.enable()
    adaptive_eager.reset_stats()
    t0 = time.perf_counter()
    try:
        neuron = run_pipeline(copy.deepcopy(pristine), case, torch.device("neuron"), lambda s: progress("neuron:" + s))
    except StageError as failure:
        record.update(status="fail", stage=failure.stage, error=_one_line(failure.error))
        neuron = None
    finally:
        try:
            stats = adaptive_eager.stats()
            record["fallback_ops"] = stats["fallback_ops"]
        except BaseException as error:  # noqa: BLE001
            record["fallback_ops"] = {"<stats failed>": _one_line(error)}
    record["neuron_seconds"] = round(time.perf_counter() - t0, 2)
    if neuron is not None:
        record["launches"] = {"adaptive": neuron["launches_fwd_bwd"], "ops": neuron["ops_fwd_bwd"]}
        record["patterns"] = neuron.get("patterns_fwd_bwd", {})

        # 4. compare with the CPU
        progress("compare")
        try:
            replayed = replay_step(pristine, neuron["grads"])
        except Exception:  # noqa: BLE001 - e.g. the parameter sets differ
            replayed = None
        diffs, problems, generate = compare(neuron, cpu, replayed)
        record["max_diff"] = diffs
        record["generate"] = generate
        if problems:
            record.update(status="fail", stage="compare", error="; ".join(problems)[:400])
        else:
            record["status"] = "ok"

    # 5. strict eager, forward + backward, for the launch count
    if strict and neuron is not None:
        adaptive_eager.disable()
        adaptive_eager.reset_stats()
        try:
            strict_out = run_pipeline(copy.deepcopy(pristine), case, torch.device("neuron"),
                                      lambda s: progress("strict:" + s), fwd_bwd_only=True)
            record["launches"]["strict"] = strict_out["launches_fwd_bwd"]
            d, _ = _maxdiff(strict_out["loss"], cpu["loss"])
            record["strict_loss_diff"] = d
        except StageError as failure:
            record["strict_error"] = f"{failure.stage}: {_one_line(failure.error)}"
        finally:
            adaptive_eager.enable()
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def _worker_main(model_type: str, progress_path: str) -> None:
    import torch

    torch.set_num_threads(1)

    def progress(stage):
        with open(progress_path, "a") as handle:
            handle.write(stage + "\n")

    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass
    try:
        record = run_architecture(model_type, progress)
    except BaseException as error:  # noqa: BLE001
        record = {"model_type": model_type, "status": "fail", "stage": "harness",
                  "error": _one_line(error), "traceback": traceback.format_exc()[-2000:]}
    print("@@RESULT " + json.dumps(record, default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (device worker thread, atexit dumps)


# -- the driver ---------------------------------------------------------------------------
def _architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_in_subprocess(model_type: str, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("w+", suffix=".progress", delete=False) as handle:
        progress_path = handle.name
    env = dict(os.environ, NEURON_ADAPTIVE_EAGER="1", OMP_NUM_THREADS="1")
    env.pop("NEURON_FUSION_STATS", None)
    command = [sys.executable, "-m", "bench.hf_models", "--worker", model_type, "--progress", progress_path]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        output, errors, timed_out = done.stdout, done.stderr, False
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        errors = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        timed_out = True
        done = None
    try:
        with open(progress_path) as handle:
            stages = handle.read().split()
    finally:
        os.unlink(progress_path)
    for line in output.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    last = stages[-1] if stages else "start"
    buildable = last.startswith(("neuron:", "strict:", "compare"))
    stage = last.split(":", 1)[-1] if buildable else last
    if timed_out:
        error = f"timed out after {timeout:.0f} s in {last}"
    else:
        tail = [line for line in errors.strip().splitlines() if line.strip()]
        error = f"process died (exit {done.returncode}) in {last}: " + (tail[-1] if tail else "no output")
    return {
        "model_type": model_type,
        "status": "fail" if buildable else "not_buildable",
        "stage": stage,
        "error": error[:400],
        "seconds": round(time.perf_counter() - started, 2),
    }


def _source_state() -> dict:
    """The commit the sweep ran on, and files of the device/runtime that differed from it."""
    def git(*argv):
        try:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            return ""

    dirty = [line.split(maxsplit=1)[-1]
             for line in git("status", "--porcelain", "--", "device", "fusion", "adaptive_eager").splitlines()]
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_device_runtime_files": dirty}


def summarize(records: dict, seconds: float) -> dict:
    counts = collections.Counter(r["status"] for r in records.values())
    buildable = counts["ok"] + counts["fail"]
    return {
        "architectures": len(records),
        "ok": counts["ok"],
        "fail": counts["fail"],
        "not_buildable": counts["not_buildable"],
        "buildable": buildable,
        "pct_ok_of_buildable": round(100.0 * counts["ok"] / buildable, 1) if buildable else None,
        "pct_ok_of_all": round(100.0 * counts["ok"] / len(records), 1) if records else None,
        "seconds": round(seconds, 1),
    }


def _error_key(record: dict) -> str:
    error = record.get("error", "")
    error = re.sub(r"0x[0-9a-f]+", "0x?", error)
    error = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", error)
    return f"{record.get('stage')}: {error[:120]}"


def report(records: dict, summary: dict) -> list[str]:
    lines = []
    header = f"{'architecture':<26}{'status':<15}{'stage':<16}{'strict':>8}{'adaptive':>9}{'loss':>10}{'logits':>10}{'grads':>10}{'step':>9}{'params':>10}{'gen':>5}  fallback"
    lines += [header, "-" * len(header)]
    for name, r in records.items():
        launches = r.get("launches", {})
        d = r.get("max_diff", {})

        def f(key):
            return f"{d[key]:.1e}" if key in d else "-"

        gen = r.get("generate", {})
        gen_text = "-" if not gen else ("=" if gen.get("equal") else ("tie" if gen.get("near_tie") else "!="))
        fallback = ",".join(sorted(r.get("fallback_ops", {}) or {}))
        lines.append(
            f"{name:<26}{r['status']:<15}{(r.get('stage') or '') if r['status'] != 'ok' else '':<16}"
            f"{launches.get('strict', '-'):>8}{launches.get('adaptive', '-'):>9}"
            f"{f('loss'):>10}{f('logits'):>10}{f('grads'):>10}{f('step'):>9}{f('params'):>10}{gen_text:>5}  {fallback}"
        )
    lines.append("")
    for status, title in (("fail", "failures"), ("not_buildable", "cannot be built tiny offline")):
        groups = collections.defaultdict(list)
        for name, r in records.items():
            if r["status"] == status:
                groups[_error_key(r)].append(name)
        if not groups:
            continue
        lines.append(f"{title}, grouped by error:")
        for key, names in sorted(groups.items(), key=lambda item: -len(item[1])):
            example = records[names[0]]
            lines.append(f"  [{len(names)}] {', '.join(names)}")
            lines.append(f"      {example.get('stage')}: {example.get('error', '')[:300]}")
        lines.append("")
    fallback = collections.Counter()
    for r in records.values():
        for op in r.get("fallback_ops", {}) or {}:
            fallback[op] += 1
    if fallback:
        lines.append("ops that fell back to the CPU (architectures): " + ", ".join(f"{op} ({n})" for op, n in fallback.most_common()))
        lines.append("")
    matched = collections.Counter()
    for r in records.values():
        for name in r.get("patterns", {}) or {}:
            matched[name] += 1
    lines.append(
        "library kernels matched in the training step (architectures): "
        + (", ".join(f"{name} ({n})" for name, n in matched.most_common()) or "none")
    )
    lines.append("")
    s = summary
    lines.append(
        f"{s['ok']}/{s['buildable']} architectures that build tiny offline work out of the box on neuron "
        f"(adaptive eager) = {s['pct_ok_of_buildable']}%; {s['fail']} fail; {s['not_buildable']} of "
        f"{s['architectures']} cannot be built tiny offline; {s['ok']}/{s['architectures']} = "
        f"{s['pct_ok_of_all']}% of all. {s['seconds']:.0f} s."
    )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (e.g. llama,gpt2)")
    parser.add_argument("--limit", type=int, help="the first N architectures only")
    parser.add_argument("--jobs", type=int, default=2, help="architectures run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per architecture")
    parser.add_argument("--json", help="write results here (default for a full sweep: bench/results/latest/hf_models.json, "
                                       "or bench/results/hf_models.json with --save)")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # no hub access: everything is built from configs (inherited by the workers)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.worker:
        _worker_main(args.worker, args.progress or os.devnull)
        return 0

    import torch
    import transformers

    names = _architectures()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"not causal-LM architectures of transformers {transformers.__version__}: {', '.join(unknown)}")
        names = wanted
    if args.limit:
        names = names[: args.limit]
    partial = bool(args.only or args.limit)

    started = time.perf_counter()
    records: dict = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_in_subprocess, name, args.timeout): name for name in names}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            record = future.result()
            records[name] = record
            print(f"[{len(records)}/{len(names)}] {name}: {record['status']}"
                  + (f" ({record.get('stage')}: {record.get('error', '')[:150]})" if record["status"] != "ok" else "")
                  + f" {record.get('seconds', 0):.0f} s", flush=True)
    records = {name: records[name] for name in names}
    summary = summarize(records, time.perf_counter() - started)
    print()
    print("\n".join(report(records, summary)))

    path = args.json or (None if partial else results_path("hf_models.json", args.save))
    if path:
        result = {
            "command": "python -m bench.hf_models " + " ".join(argv if argv is not None else sys.argv[1:]),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "jobs": args.jobs,
            "timeout_s": args.timeout,
            "source": _source_state(),
            "taken": provenance(),
            "tiny": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                     "ffn": FFN, "experts": EXPERTS, "top_k": TOP_K, "vocab": VOCAB, "batch": BATCH, "seq": SEQ,
                     "new_tokens": NEW_TOKENS, "lr": LR},
            "tolerances": {k: {"atol": a, "rtol": r} for k, (a, r) in TOLERANCES.items()},
            "summary": summary,
            "architectures": records,
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            json.dump(result, handle, indent=1, sort_keys=False, default=str)
            handle.write("\n")
        print(f"wrote {path}")
    failed = [name for name, record in records.items() if record["status"] not in ("ok", "not_buildable")]
    if failed:  # the exit status says whether every buildable architecture passed
        print(f"{len(failed)} architecture(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
