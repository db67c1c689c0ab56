"""Benchmark workloads, written the way users write them: fixed seeds, moderate sizes for
two cores, and ``.to(device)`` as the only device-specific code.

Each workload is a :class:`Workload`: ``build(device)`` returns a ``step()`` callable that
runs one training (or decoding) step and returns a CPU tensor to compare across modes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Workload:
    name: str
    description: str
    build: Callable[[str], Callable[[], torch.Tensor]]
    steps: int = 9
    quick_steps: int = 5


def classifier_step(model, optimizer, device: str, x, y):
    """One classification training step on a fixed batch."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        return loss.detach().cpu()

    return step


def language_model_step(model, optimizer, device: str, clip: float | None = None):
    """One next-token training step on a fixed batch: what users write."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (8, 65), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.to(device).reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss.detach().cpu()

    return step


# -- mlp ---------------------------------------------------------------------------------


def build_mlp(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    return classifier_step(model, optimizer, device, x, y)


# -- cnn ---------------------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def build_cnn(device: str):
    torch.manual_seed(0)
    model = ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    return classifier_step(model, optimizer, device, x, y)


# -- gpt ---------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q = q.view(batch, seq, self.heads, -1).transpose(1, 2)
        k = k.view(batch, seq, self.heads, -1).transpose(1, 2)
        v = v.view(batch, seq, self.heads, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(seq, seq, device=x.device)).view(1, 1, seq, seq)
        att = att.masked_fill(mask == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(batch, seq, dim)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(dim, 4 * dim), c_proj=nn.Linear(4 * dim, dim)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = self.mlp.c_fc(self.ln_2(x))
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.mlp.c_proj(h)


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        positions = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(device: str):
    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return language_model_step(model, optimizer, device, clip=1.0)


# -- llama ---------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, hidden_states, cos, sin, attention_mask):
        batch, seq, _ = hidden_states.shape
        shape = (batch, seq, self.heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        weights = weights + attention_mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).contiguous().reshape(batch, seq, -1)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(dim, heads)
        self.mlp = LlamaMLP(dim, hidden)
        self.input_layernorm = LlamaRMSNorm(dim)
        self.post_attention_layernorm = LlamaRMSNorm(dim)

    def forward(self, hidden_states, cos, sin, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class Llama(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, hidden: int = 344, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = LlamaRMSNorm(dim)
        self.rotary_emb = LlamaRotaryEmbedding(dim // heads)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        batch, seq = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, -1)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        mask = torch.full((seq, seq), float("-inf"), device=input_ids.device).triu(1)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, mask)
        return self.lm_head(self.norm(hidden_states))


def build_llama(device: str):
    torch.manual_seed(0)
    model = Llama().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return language_model_step(model, optimizer, device)


# -- decode --------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x, cache):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.proj(y)
        x = x + self.out(F.gelu(self.fc(self.ln_2(x))))
        return x, (k, v)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, caches=None):
        x = self.embed(tokens)
        caches = caches or [None] * len(self.layers)
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer(x, cache)
            new_caches.append(cache)
        return self.head(self.ln(x)), new_caches


def greedy_decode(model, prompt, new_tokens: int):
    """Greedy decoding with the KV cache: the tokens after ``prompt`` (on its device)."""
    logits, caches = model(prompt)
    generated = []
    for _ in range(new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_token)
        logits, caches = model(next_token, caches)
    return torch.cat(generated, dim=1)


def build_decode(device: str, new_tokens: int = 16):
    torch.manual_seed(0)
    model = Decoder().to(device).eval()
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def step():
        return greedy_decode(model, prompt.to(device), new_tokens).cpu()

    return step


# -- optimizer ---------------------------------------------------------------------------


def build_optimizer(device: str):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 64).to(device)) for _ in range(24)]
    params += [nn.Parameter(torch.randn(64).to(device)) for _ in range(24)]
    for p in params:
        # drawn on the CPU, as the parameters are: a draw on neuron uses the device's own
        # generator (as on CUDA), and the CPU reference run would see other gradients
        p.grad = (torch.randn(p.shape) * 0.01).to(device)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

    def step():
        optimizer.step()
        return params[0].detach()[0].cpu()

    return step


WORKLOADS = {
    w.name: w
    for w in [
        Workload("mlp", "3-layer MLP, batch 64, AdamW training step", build_mlp),
        Workload("cnn", "conv/batchnorm/relu/pool, batch 16 of 32x32, SGD momentum step", build_cnn),
        Workload("gpt", "2 GPT-2 blocks (hand-written attention, LayerNorm, tanh GELU), 8x64 tokens, AdamW", build_gpt),
        Workload("llama", "2 Llama blocks as Hugging Face writes them (RMSNorm, rotary, SiLU-gated MLP, eager attention), 8x64 tokens, AdamW", build_llama),
        Workload("decode", "greedy decoding of 16 tokens with a KV cache, batch 1, 2 layers", build_decode, steps=7, quick_steps=5),
        Workload("optimizer", "AdamW step over 48 small parameters", build_optimizer),
    ]
}
