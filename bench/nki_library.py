"""Run AWS's nki-library kernels, unmodified, on the simulated NKI against their own PyTorch references.

    python bench/nki_library.py /path/to/nki-library [--only NAME] [--table FILE]

The checkout is AWS's ``aws-neuron/nki-library`` (Apache-2.0; never copied into this repository).
Each case imports a kernel and its ``*_torch.py`` reference from the checkout, builds inputs the way
the library's own integration tests do (test/integration/nkilib/..., shapes from their "fast"
parameter lists), runs the kernel with ``nki.run`` (``kernel[lnc]`` for LNC2 cases), runs the
reference on the same inputs, and compares with the tolerances the library's tests use, by the library's own comparator
(``maxAllClose`` in test/integration/nkilib/utils/comparators.py, default mode: |a - b| <= atol +
rtol * max|b|). It prints
a table: kernel | imports | runs | equals reference | simulated time | why not.

The only thing supplied besides ``nki``: ``neuronxcc.nki.typing`` (router_topk imports the legacy
package for its ``nt.mutable_tensor`` annotations; the library depends on neuronx-cc being
installed). The stand-in defines those annotation names and nothing else; it is installed only if
no real ``neuronxcc`` is importable, and the table says which kernels needed it.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
import traceback
import types

import ml_dtypes
import numpy as np

import nki
import nki.language as nl

USED_STANDIN = set()


def _install_neuronxcc_standin():
    try:
        importlib.import_module("neuronxcc.nki.typing")
        return
    except ImportError:
        pass
    typing = types.ModuleType("neuronxcc.nki.typing")
    typing.mutable_tensor = nl.NkiTensor
    typing.tensor = nl.NkiTensor
    typing.__doc__ = "stand-in (bench/nki_library.py): annotation names only"
    pkg = types.ModuleType("neuronxcc")
    sub = types.ModuleType("neuronxcc.nki")
    pkg.nki, sub.typing = sub, typing
    pkg.__path__, sub.__path__ = [], []

    class _Finder:
        def find_module(self, name, path=None):
            return None

    sys.modules.setdefault("neuronxcc", pkg)
    sys.modules.setdefault("neuronxcc.nki", sub)
    sys.modules.setdefault("neuronxcc.nki.typing", typing)


@dataclasses.dataclass
class Case:
    name: str  # table row
    kernel: str  # "module:attr" under nkilib_src.nkilib
    reference: str  # "module:attr"
    inputs: callable  # () -> dict of kernel arguments (numpy arrays and options); "x.must_alias_input" keys
    lnc: int = 1
    rtol: float = 1e-3
    atol: float = 1e-3
    note: str = ""
    ref_kwargs: callable = None  # inputs -> extra reference kwargs
    standin: bool = False
    expect_error: str = ""  # the run must fail with this (a capacity check on a real kernel)
    ref_float32: bool = False  # run the reference on the same values upcast to float32 (see the case's note)


def _rng():
    return np.random.default_rng(42)


def gaussian(shape, dtype, scale=1.0, seed=None):
    rng = np.random.default_rng(seed) if seed is not None else _RNG
    return (rng.standard_normal(shape) * scale).astype(dtype)


_RNG = np.random.default_rng(0)


def to_torch(value):
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
        if value.dtype == ml_dtypes.float8_e4m3:
            return torch.from_numpy(value.astype(np.float32))
        return torch.from_numpy(value.copy())
    return value


def to_numpy(value):
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.float().numpy()
        return value.numpy()
    return np.asarray(value)


# -- the cases ------------------------------------------------------------------------------------------


def cases():
    bf16, f16, f32 = ml_dtypes.bfloat16, np.float16, np.float32
    out = []
    np.random.seed(42)
    for batch, hidden, ndim, seq, dtype in [(1, 256, 2, 1, f32), (64, 1024, 3, 4, bf16), (128, 2048, 2, 1, f32)]:
        shape = (batch, seq, hidden) if ndim == 3 else (batch, hidden)
        out.append(Case(f"cumsum {shape} {np.dtype(dtype).name}", "core.cumsum.cumsum:cumsum",
                        "core.cumsum.cumsum_torch:cumsum_torch_ref",
                        lambda shape=shape, dtype=dtype: {"x": np.random.randn(*shape).astype(dtype)},
                        atol=1e-3, rtol=1e-2 if dtype == bf16 else 1e-3))
    for d_head, B, n_heads, S, contiguous, relayout in [(128, 2, 4, 64, True, False), (64, 1, 8, 16, False, False),
                                                        (64, 1, 8, 16, False, True)]:
        for lnc in (1, 2):
            out.append(Case(f"RoPE d{d_head} B{B} H{n_heads} S{S} {'contig' if contiguous else 'interleaved'}"
                            f"{' relayout' if relayout else ''} lnc{lnc}", "core.embeddings.rope:RoPE",
                            "core.embeddings.rope_torch:rope_torch_ref",
                            lambda d=d_head, B=B, h=n_heads, S=S, c=contiguous, r=relayout: {
                                "x_in": gaussian((d, B, h, S), bf16), "cos": gaussian((d // 2, B, S), bf16),
                                "sin": gaussian((d // 2, B, S), bf16), "lnc_shard": True, "contiguous_layout": c,
                                "relayout_in_sbuf": r},
                            lnc=lnc, rtol=2 ** -7, atol=1e-3))
    for bs, qh, kvh, sl, hd, dtype, backward, packed in [(1, 32, 8, 256, 128, bf16, False, False),
                                                        (1, 32, 8, 256, 128, f32, False, False),
                                                        (1, 32, 8, 256, 128, f32, True, False),
                                                        (1, 32, 8, 256, 128, bf16, False, True)]:
        for lnc in (1, 2):
            out.append(Case(f"rope_hf bs{bs} qh{qh} kvh{kvh} sl{sl} hd{hd} {np.dtype(dtype).name}"
                            f"{' backward' if backward else ''}{' rope_cache' if packed else ''} lnc{lnc}",
                            "core.embeddings.rope_hf:rope_hf", "core.embeddings.rope_hf_torch:rope_hf_torch_ref",
                            lambda a=(bs, qh, kvh, sl, hd, dtype, backward, packed): _rope_hf_inputs(*a),
                            lnc=lnc, rtol=1e-6, atol=1e-6))
    for lnc, batch, seqlen, hidden, actual, tp in [(1, 1, 1, 8192, None, False), (1, 1, 4, 2048, 1920, False),
                                                   (1, 1, 1, 4096, 3072, True), (2, 2, 8, 8192, None, False),
                                                   (2, 128, 5, 3072, None, False)]:
        ref = "rmsnorm_tkg_torch_ref" if lnc == 2 and not tp else "rmsnorm_tkg_torch_ref_lnc1"
        out.append(Case(f"rmsnorm_tkg B{batch} S{seqlen} H{hidden} ha{actual} tp{int(tp)} lnc{lnc}",
                        "core.subkernels.rmsnorm_tkg:rmsnorm_tkg", f"core.subkernels.rmsnorm_torch:{ref}",
                        lambda b=batch, s=seqlen, h=hidden, a=actual, tp=tp: _norm_inputs(b, s, h, f16, {
                            "hidden_actual": a, "hidden_dim_tp": tp, "shard_on_h": False}),
                        lnc=lnc, rtol=2e-2, atol=1e-5))
    for lnc, batch, seqlen, hidden in [(1, 1, 1, 4096), (1, 4, 8, 2048), (2, 2, 8, 8192)]:
        ref = "layernorm_tkg_torch_ref" if lnc == 2 else "layernorm_tkg_torch_ref_lnc1"
        out.append(Case(f"layernorm_tkg B{batch} S{seqlen} H{hidden} lnc{lnc}",
                        "core.subkernels.layernorm_tkg:layernorm_tkg", f"core.subkernels.layernorm_torch:{ref}",
                        lambda b=batch, s=seqlen, h=hidden: _layernorm_inputs(b, s, h, f16),
                        lnc=lnc, rtol=2e-2, atol=1e-5))
    for T, H, E, k, act, bias, prenorm, normprob, coltile, scatter, hbm_layout, sb_layout in [
            (4, 3072, 128, 4, "SOFTMAX", True, False, False, False, False, 0, 0),
            (16, 3072, 128, 4, "SOFTMAX", True, False, False, True, False, 1, 1),
            (128, 3072, 128, 4, "SOFTMAX", False, False, False, False, False, 1, 2),
            (8, 8192, 128, 8, "SIGMOID", True, True, True, False, True, 0, 0),
            (8, 3072, 128, 4, "SOFTMAX", True, True, False, False, False, 1, 1)]:
        out.append(Case(f"router_topk T{T} H{H} E{E} k{k} {act.lower()} bias{int(bias)} prenorm{int(prenorm)} "
                        f"normprob{int(normprob)} coltile{int(coltile)} scatter{int(scatter)} x{hbm_layout}/{sb_layout}",
                        "core.router_topk.router_topk:router_topk", "core.router_topk.router_topk_torch:router_topk_torch_ref",
                        lambda a=(T, H, E, k, act, bias, prenorm, normprob, coltile, scatter, hbm_layout, sb_layout):
                        _router_inputs(*a), rtol=2e-2, atol=1e-5, standin=True, ref_float32=True,
                        note="reference on the bf16 inputs upcast to float32: in bf16 its logits tie and argsort breaks "
                             "the ties arbitrarily, where the kernel (float32 PSUM) has no ties"))
    for B, T, V, dtype, pb, cs in [(1, 1, 32128, bf16, 1, 32128), (2, 64, 32128, bf16, 64, 32128),
                                   (1, 96, 40000, f32, 32, 16384)]:
        for lnc in (1, 2):
            out.append(Case(f"cross_entropy_forward B{B} T{T} V{V} {np.dtype(dtype).name} PB{pb} CS{cs} lnc{lnc}",
                            "experimental.loss.cross_entropy:cross_entropy_forward",
                            "experimental.loss.cross_entropy_torch:cross_entropy_forward_torch_ref",
                            lambda B=B, T=T, V=V, dtype=dtype, pb=pb, cs=cs: _ce_inputs(B, T, V, dtype, pb, cs),
                            lnc=lnc, rtol=2e-2 if dtype == bf16 else 1e-4, atol=1e-5, ref_kwargs=_ce_ref,
                            note="tolerance ours (the library's test states none)"))
    for B, T, V, dtype, pb, cs, reduction in [(1, 1, 32128, bf16, 1, 16384, "mean"), (2, 64, 32128, bf16, 64, 16384, "mean"),
                                              (1, 96, 32128, f32, 64, 8192, "sum")]:
        for lnc in (1, 2):
            out.append(Case(f"cross_entropy_backward B{B} T{T} V{V} {np.dtype(dtype).name} {reduction} lnc{lnc}",
                            "experimental.loss.cross_entropy:cross_entropy_backward", "OURS:ce_backward_reference",
                            lambda a=(B, T, V, dtype, pb, cs, reduction): _ce_backward_inputs(*a), lnc=lnc,
                            rtol=2e-2 if dtype == bf16 else 1e-4, atol=1e-5,
                            note="reference: the library's cross_entropy_backward_torch_ref (the lse input from its "
                                 "forward reference, as its test does); tolerance ours"))
    out.append(Case("cross_entropy_backward B2 T64 V32128 bfloat16 PB64 CS32128 (too big: must not fit)",
                    "experimental.loss.cross_entropy:cross_entropy_backward", "OURS:ce_backward_reference",
                    lambda: _ce_backward_inputs(2, 64, 32128, bf16, 64, 32128, "mean"), rtol=2e-2, atol=1e-5,
                    expect_error="SBUF overflow",
                    note="5 chunk tiles of 32128 elements per partition (64 KiB bf16, 128 KiB fp32 mask) exceed "
                         "the 224 KiB SBUF partition; the library's tests use CS=16384 for this"))
    for bs, skv, sq, d, scale, dtype, causal, tp_q, tp_out in [(1, 128, 128, 128, 1.0, bf16, True, False, True),
                                                                (1, 512, 256, 64, 0.5, f32, False, True, False),
                                                                (2, 384, 384, 128, 0.125, bf16, True, True, False)]:
        for lnc in (1, 2):
            out.append(Case(f"attention_cte bs{bs} kv{skv} q{sq} d{d} {np.dtype(dtype).name} causal{int(causal)} "
                            f"tp_q{int(tp_q)} tp_out{int(tp_out)} lnc{lnc}",
                            "core.attention.attention_cte:attention_cte",
                            "core.attention.attention_cte_torch:attention_cte_torch_ref",
                            lambda a=(bs, skv, sq, d, scale, dtype, causal, tp_q, tp_out): _attn_cte_inputs(*a),
                            lnc=lnc, rtol=2e-2, atol=1e-5))
    for bs, heads, s_active, sprior, d, lnc in [(2, 1, 1, 256, 128, 1), (2, 4, 2, 512, 128, 1), (1, 8, 1, 1024, 64, 2)]:
        out.append(Case(f"attention_tkg bs{bs} heads{heads} s_active{s_active} s_prior{sprior} d{d} lnc{lnc}",
                        "OURS:attention_tkg_entry", "OURS:attention_tkg_reference",
                        lambda a=(bs, heads, s_active, sprior, d, bf16, lnc): _attn_tkg_inputs(*a), lnc=lnc,
                        rtol=1e-2, atol=1e-5,
                        note="entry: ours (SbufManager, output allocation, then attention_tkg, as the library's test "
                             "wrapper does); flat KV cache, fused RoPE, mask from the library's build_full_attention_mask"))
    for B, S, H, I, dtype in [(1, 4, 1024, 2048, bf16), (2, 128, 1024, 1024, bf16)]:
        out.append(Case(f"mlp B{B} S{S} H{H} I{I} {np.dtype(dtype).name} (mlp.py entry point)", "core.mlp.mlp:mlp",
                        "OURS:gated_mlp", lambda B=B, S=S, H=H, I=I, dtype=dtype: _mlp_inputs(B, S, H, I, dtype),
                        rtol=2e-2, atol=1e-5))
        out.append(Case(f"mlp B{B} S{S} H{H} I{I} {np.dtype(dtype).name} (MLPParameters -> mlp_{'tkg' if B * S <= 96 else 'cte'})",
                        "OURS:mlp_entry", "OURS:gated_mlp", lambda B=B, S=S, H=H, I=I, dtype=dtype: _mlp_inputs(B, S, H, I, dtype),
                        rtol=2e-2, atol=1e-5,
                        note="entry: what mlp.py's mlp() does (MLPParameters, then mlp_tkg or mlp_cte); reference: ours"))
    return out


def _router_inputs(T, H, E, k, act, bias, prenorm, normprob, coltile, scatter, hbm_layout, sb_layout):
    from nkilib_src.nkilib.core.utils.common_types import RouterActFnType

    def gen(shape):  # the library's generator: uniform [-0.1, 0.1) from torch seed 0, cast to bf16
        import torch
        g = torch.Generator()
        g.manual_seed(0)
        return torch.empty(shape, dtype=torch.float32).uniform_(-0.1, 0.1, generator=g).numpy().astype(ml_dtypes.bfloat16)

    x_shape = (T, H) if hbm_layout == 1 else (H, T)
    return {"x": gen(x_shape), "w": gen((H, E)), "w_bias": gen((1, E)) if bias else None,
            "router_logits.must_alias_input": np.zeros((T, E), dtype=ml_dtypes.bfloat16),
            "expert_affinities.must_alias_input": np.zeros((T, E), dtype=ml_dtypes.bfloat16),
            "expert_index.must_alias_input": np.zeros((T, k), dtype=np.uint32),
            "act_fn": getattr(RouterActFnType, act), "k": k, "x_hbm_layout": hbm_layout, "x_sb_layout": sb_layout,
            "router_pre_norm": prenorm, "norm_topk_prob": normprob, "use_column_tiling": coltile,
            "use_indirect_dma_scatter": scatter}


def _ce_inputs(B, T, V, dtype, pb, cs):
    np.random.seed(42)
    return {"logits_hbm": np.random.randn(B * T, V).astype(dtype),
            "targets_hbm": np.random.randint(0, V, size=(B * T,), dtype=np.int32),
            "positions_per_batch": pb, "chunk_size": cs,
            "dtype": nl.bfloat16 if dtype == ml_dtypes.bfloat16 else nl.float32}


def _ce_ref(kwargs):
    import torch
    return {"logits": kwargs["logits_hbm"], "targets": kwargs["targets_hbm"].long()}


def _ce_backward_inputs(B, T, V, dtype, pb, cs, reduction):
    import torch
    from nkilib_src.nkilib.experimental.loss.cross_entropy_torch import cross_entropy_forward_torch_ref

    inputs = _ce_inputs(B, T, V, dtype, pb, cs)
    _, lse = cross_entropy_forward_torch_ref(to_torch(inputs["logits_hbm"]),
                                             torch.from_numpy(inputs["targets_hbm"]).long())
    inputs["lse_state_hbm"] = lse.float().numpy().astype(dtype)
    inputs["reduction"] = reduction
    return inputs


def ce_backward_reference(logits_hbm, targets_hbm, lse_state_hbm, reduction, **_):
    from nkilib_src.nkilib.experimental.loss.cross_entropy_torch import cross_entropy_backward_torch_ref

    return {"grad_logits_hbm": cross_entropy_backward_torch_ref(logits_hbm, targets_hbm.long(), reduction)}


def _attn_cte_inputs(bs, skv, sq, d, scale, dtype, causal, tp_q, tp_out):
    np.random.seed(0)  # the library's np_random_sample: uniform [0, 1)
    rnd = lambda shape: np.random.random_sample(shape).astype(dtype)  # noqa: E731
    return {"q": rnd((bs, sq, d) if tp_q else (bs, d, sq)), "k": rnd((bs, d, skv)), "v": rnd((bs, skv, d)),
            "scale": scale, "causal_mask": causal, "tp_q": tp_q, "tp_k": False, "tp_out": tp_out}


def _attn_tkg_inputs(bs, heads, s_active, sprior, d, dtype, lnc):
    import torch
    from nkilib_src.nkilib.core.attention.attention_tkg_utils import AttnTKGConfig
    from nkilib_src.nkilib.core.attention.gen_mask_tkg_torch import build_full_attention_mask

    cfg = AttnTKGConfig(bs=bs, q_head=heads, s_active=s_active, curr_sprior=sprior, full_sprior=sprior, d_head=d,
                        block_len=0, tp_k_prior=True, use_pos_id=False, fuse_rope=True)
    np.random.seed(0)
    rnd = lambda shape: np.random.random_sample(shape).astype(dtype)  # noqa: E731  (the library's np_random_sample)
    pos_id = ((np.arange(bs) * 3 + (sprior // 4 * 3)) % (sprior - s_active))[:, None]
    mask = build_full_attention_mask(cache_lens=torch.from_numpy(pos_id.flatten()).to(torch.float32), batch=bs,
                                     num_heads=heads, s_active=s_active, s_ctx=sprior, lnc=lnc, block_len=0,
                                     include_active_mask=True, transposed=True).numpy().astype(np.uint8)
    return {"q": rnd((bs, heads, s_active, d)), "k_active": rnd((bs, 1, s_active, d)),
            "v_active": rnd((bs, 1, s_active, d)), "k_prior": rnd((bs, 1, sprior, d)),
            "v_prior": rnd((bs, 1, sprior, d)), "mask": mask, "cfg": cfg, "lnc": lnc,
            "inv_freqs": np.random.random(size=(d // 2, 1)).astype(np.float32),
            "rope_pos_ids": np.broadcast_to(pos_id, (bs, s_active)).astype(np.float32).copy()}


def attention_tkg_entry(q, k_active, v_active, k_prior, v_prior, mask, cfg, lnc, inv_freqs, rope_pos_ids):
    """Our entry: an SbufManager and the output, then the library's attention_tkg (its test wraps it
    the same way)."""
    from nkilib_src.nkilib.core.attention.attention_tkg import attention_tkg
    from nkilib_src.nkilib.core.utils.allocator import SbufManager
    from nkilib_src.nkilib.core.utils.logging import Logger

    sbm = SbufManager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, Logger("SBM"))
    sbm.open_scope()
    out = nl.ndarray((cfg.bs, cfg.q_head, cfg.d_head, cfg.s_active), dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = nl.ndarray((cfg.bs, 1, cfg.d_head, cfg.s_active), dtype=q.dtype, buffer=nl.shared_hbm)
    attn_out, k_out = attention_tkg(q, k_active, v_active, k_prior, v_prior, mask, out, cfg, sbm, inv_freqs=inv_freqs,
                                    rope_pos_ids=rope_pos_ids, k_out=k_out)
    sbm.close_scope()
    return attn_out, k_out


def attention_tkg_reference(q, k_active, v_active, k_prior, v_prior, mask, cfg, lnc, inv_freqs, rope_pos_ids):
    import torch
    from nkilib_src.nkilib.core.attention.attention_tkg_torch import attention_tkg_torch_ref

    out = torch.zeros((cfg.bs, cfg.q_head, cfg.d_head, cfg.s_active), dtype=torch.float32)
    k_out = torch.zeros((cfg.bs, 1, cfg.d_head, cfg.s_active), dtype=torch.float32)
    result, k_result = attention_tkg_torch_ref[lnc](q=q, k_active=k_active, v_active=v_active, k_prior=k_prior,
                                                    v_prior=v_prior, mask=mask, out=out, cfg=cfg, sbm=None,
                                                    inv_freqs=inv_freqs, rope_pos_ids=rope_pos_ids, k_out=k_out)
    return {"out": result, "k_out": k_result}


def _mlp_inputs(B, S, H, I, dtype):
    np.random.seed(0)
    return {"hidden_tensor": (np.random.randn(B, S, H) * 0.5).astype(dtype),
            "gate_proj_weights_tensor": (np.random.randn(H, I) / np.sqrt(H)).astype(dtype),
            "up_proj_weights_tensor": (np.random.randn(H, I) / np.sqrt(H)).astype(dtype),
            "down_proj_weights_tensor": (np.random.randn(I, H) / np.sqrt(I)).astype(dtype)}


def gated_mlp(hidden_tensor, gate_proj_weights_tensor, up_proj_weights_tensor, down_proj_weights_tensor, **_):
    """Our reference: silu(x @ Wg) * (x @ Wu) @ Wd, float32 math, output in x's dtype (nki-library
    keeps its MLP reference in its test code, test_mlp_common.py, not in a *_torch.py)."""
    import torch
    x, g, u, d = (t.float() for t in (hidden_tensor, gate_proj_weights_tensor, up_proj_weights_tensor,
                                      down_proj_weights_tensor))
    h = torch.nn.functional.silu(x @ g) * (x @ u)
    return {"out": (h.to(hidden_tensor.dtype).float() @ d).to(hidden_tensor.dtype)}


def mlp_entry(hidden_tensor, gate_proj_weights_tensor, up_proj_weights_tensor, down_proj_weights_tensor):
    """Our entry point doing what nki-library's mlp() does (its mlp.py does not parse at d2ad3a57):
    build MLPParameters, allocate the output, run mlp_tkg (B*S <= 96) or mlp_cte."""
    from nkilib_src.nkilib.core.mlp.mlp_cte.mlp_cte import mlp_cte
    from nkilib_src.nkilib.core.mlp.mlp_parameters import MLPParameters, is_mlp_tkg, validate_mlp_arguments
    from nkilib_src.nkilib.core.mlp.mlp_tkg.mlp_tkg import mlp_tkg
    from nkilib_src.nkilib.core.utils.allocator import SbufManager
    from nkilib_src.nkilib.core.utils.logging import Logger

    params = MLPParameters(hidden_tensor=hidden_tensor, gate_proj_weights_tensor=gate_proj_weights_tensor,
                           up_proj_weights_tensor=up_proj_weights_tensor,
                           down_proj_weights_tensor=down_proj_weights_tensor)
    validate_mlp_arguments(params)
    sbm = SbufManager(0, 200 * 1024, Logger("mlp"))
    out = sbm.alloc((params.batch_size, params.sequence_len, params.hidden_size), dtype=params.output_dtype,
                    buffer=nl.shared_hbm, name="output_tensor_hbm")
    if is_mlp_tkg(params):
        return mlp_tkg(params, out, None, sbm=sbm)
    mlp_cte(params, out, None)
    return [out]


def _rope_hf_inputs(bs, qh, kvh, sl, hd, dtype, backward, packed):
    np.random.seed(42)
    q = np.random.randn(bs, qh, sl, hd).astype(dtype)
    k = np.random.randn(bs, kvh, sl, hd).astype(dtype)
    result = {"q": q, "k": k, "q_out.must_alias_input": np.zeros_like(q), "k_out.must_alias_input": np.zeros_like(k),
              "backward": backward}
    if packed:
        result["rope_cache"] = np.random.randn(sl, hd * 2).astype(dtype)
    else:
        result["cos"] = np.random.randn(bs, sl, hd).astype(dtype)
        result["sin"] = np.random.randn(bs, sl, hd).astype(dtype)
    return result


def _norm_inputs(batch, seqlen, hidden, dtype, options):
    np.random.seed(42)
    return {"input": np.random.randn(batch, seqlen, hidden).astype(dtype),
            "gamma": np.random.randn(1, hidden).astype(dtype),
            "output.must_alias_input": np.zeros((128, batch * seqlen, hidden // 128), dtype=dtype), **options}


def _layernorm_inputs(batch, seqlen, hidden, dtype):
    np.random.seed(42)
    return {"input": np.random.randn(batch, seqlen, hidden).astype(dtype),
            "gamma": np.random.randn(1, hidden).astype(dtype),
            "output.must_alias_input": np.zeros((128, batch * seqlen, hidden // 128), dtype=dtype),
            "beta": np.random.randn(1, hidden).astype(dtype), "shard_on_h": False}


# -- running -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    name: str
    imports: str = "no"
    runs: str = "no"
    equals: str = "no"
    time_us: str = ""
    why: str = ""


def _load(spec):
    module, attr = spec.split(":")
    if module == "OURS":
        return globals()[attr]
    return getattr(importlib.import_module("nkilib_src.nkilib." + module), attr)


def _short(error: BaseException) -> str:
    tb = traceback.extract_tb(error.__traceback__)
    where = ""
    for frame in reversed(tb):
        if "nkilib" in frame.filename:
            where = f" [{frame.filename.split('nkilib/')[-1]}:{frame.lineno}]"
            break
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:300] + where


def run_case(case: Case) -> Row:
    row = Row(case.name)
    try:
        kernel = _load(case.kernel)
        reference = _load(case.reference)
    except Exception as error:  # noqa: BLE001
        row.why = "import: " + _short(error)
        return row
    row.imports = "yes" + (" (stand-in neuronxcc.nki.typing)" if case.standin else "")
    if case.note:
        row.why = case.note + "; "
    inputs = case.inputs()
    kwargs, aliased = {}, []
    for key, value in inputs.items():
        name = key.split(".")[0]
        kwargs[name] = value
        if key.endswith(".must_alias_input"):
            aliased.append(name)
    ref_inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    target = nki.jit(kernel) if not isinstance(kernel, nki.Kernel) else kernel
    if case.lnc > 1:
        target = target[case.lnc]
    try:
        started = time.perf_counter()
        result = nki.run(target, **kwargs)
        wall = time.perf_counter() - started
    except Exception as error:  # noqa: BLE001
        if case.expect_error and case.expect_error in str(error):
            row.runs = "refused, as it must"
            row.equals = "n/a"
            row.why += "; " + _short(error)
            return row
        row.why += "run: " + _short(error)
        return row
    if case.expect_error:
        row.why += f"; expected '{case.expect_error}', but it ran"
        return row
    row.runs = "yes"
    row.time_us = f"{result.time_us:.1f}"
    try:
        ref_args = {k: to_torch(v.astype(np.float32) if case.ref_float32 and isinstance(v, np.ndarray)
                                and v.dtype == ml_dtypes.bfloat16 else v) for k, v in ref_inputs.items()}
        if case.ref_kwargs is not None:
            ref_args = case.ref_kwargs(ref_args)
        expected = reference(**ref_args)
    except Exception as error:  # noqa: BLE001
        row.why += "reference: " + _short(error)
        return row
    outputs = result.outputs
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    if isinstance(expected, dict) and aliased and all(k in aliased for k in expected):
        got = [kwargs[k] for k in expected]  # outputs the kernel wrote into its arguments, by name
        expected = list(expected.values())
    else:
        if isinstance(expected, dict):
            expected = list(expected.values())
        else:
            expected = [expected] if hasattr(expected, "shape") else list(expected)
        got = [o for o in outputs if o is not None]
    if len(got) != len(expected):
        row.why += f"{len(got)} outputs vs {len(expected)} in the reference"
        return row
    worst, caveats = [], []
    ok = True
    for i, (g, e) in enumerate(zip(got, expected)):
        g = np.asarray(g).astype(np.float32)
        e = to_numpy(e).astype(np.float32)
        if g.shape != e.shape:
            ok = False
            worst.append(f"output {i}: shape {g.shape} vs {e.shape}")
            continue
        # the library's comparator (test/integration/nkilib/utils/comparators.py maxAllClose, default
        # mode "max"): |a - b| <= atol + rtol * max|b|
        brange = np.nanmax(np.abs(e[np.isfinite(e)])) if np.isfinite(e).any() else 0.0
        close = (np.abs(g.astype(np.float64) - e) <= case.atol + case.rtol * brange) | (np.isnan(g) & np.isnan(e))
        # the comparison must be able to fail: a shifted reference may not pass it
        shifted = np.roll(e.reshape(-1), 1).reshape(e.shape)
        if (np.abs(shifted.astype(np.float64) - e) <= case.atol + case.rtol * brange).all():
            caveats.append(f"output {i} is within tolerance of a shifted copy of itself (nearly constant values): "
                           "this comparison is weak")
        if not close.all():
            ok = False
            bad = np.argwhere(~close)[0]
            worst.append(f"output {i}: {int((~close).sum())}/{close.size} differ, e.g. at {tuple(bad)} "
                         f"{g[tuple(bad)]:.5g} vs {e[tuple(bad)]:.5g} (max abs diff {np.nanmax(np.abs(g - e)):.3g})")
    row.equals = "yes" if ok else "no"
    if not ok:
        row.why += "; ".join(worst)[:300]
    if caveats:
        row.why += "; ".join(caveats) + "; "
    if ok:
        row.why += f"{len(result.trace)} instructions, {wall:.1f} s wall"
    return row


def table(rows) -> str:
    lines = ["| kernel | imports | runs | equals reference | simulated us | why not / notes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.imports} | {r.runs} | {r.equals} | {r.time_us} | {r.why.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", help="path of an aws-neuron/nki-library checkout")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--table", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.abspath(args.checkout), "src"))
    _install_neuronxcc_standin()
    rows = []
    for case in cases():
        if args.only and args.only not in case.name:
            continue
        row = run_case(case)
        print(f"{row.name}: imports {row.imports}, runs {row.runs}, equals {row.equals} {row.why}", flush=True)
        rows.append(row)
    text = table(rows)
    print(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    main()
