"""Unmodified training loops, written as users write them, shared by the tests and the
benchmarks. Each ``run_*`` takes a device string and returns what the tests compare:
losses, final parameters and gradients. The only device-specific code is ``.to(device)``.

Randomness: data and initial weights are drawn first (on the CPU, identically for every
device); then ``torch.manual_seed`` is called once more right before the loop, so dropout
draws the same masks on ``neuron`` as on the CPU.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _result(model, losses):
    return {
        "losses": losses,
        "params": [p.detach().cpu() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.detach().cpu() for p in model.parameters()],
    }


def run_mlp_adamw(device: str, steps: int = 4, dtype=torch.float32):
    torch.manual_seed(0)
    data = [(torch.randn(16, 20), torch.randint(0, 5, (16,))) for _ in range(steps)]
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 5))
    model = model.to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in data:
        x, y = x.to(device=device, dtype=dtype), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return _result(model, losses)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.dropout(torch.flatten(x, 1)))


def run_cnn_sgd(device: str, steps: int = 3):
    torch.manual_seed(0)
    data = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(steps)]
    model = SmallCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1)  # dropout draws from here on
    losses = []
    model.train()
    for x, y in data:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = _result(model, losses)
    result["running_mean"] = model.bn1.running_mean.cpu()
    model.eval()
    with torch.no_grad():
        result["eval_logits"] = model(data[0][0].to(device)).cpu()
    return result


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, seq: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos))


def run_transformer(device: str, steps: int = 3):
    torch.manual_seed(0)
    data = [(torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))) for _ in range(steps)]
    model = TinyTransformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    torch.manual_seed(1)
    losses = []
    for tokens, targets in data:
        tokens, targets = tokens.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    result = _result(model, losses)
    model.eval()
    with torch.no_grad():
        result["eval_logits"] = model(data[0][0].to(device)).cpu()
    return result


def run_grad_accumulation(device: str, micro_batches: int = 3):
    torch.manual_seed(0)
    data = [(torch.randn(4, 10), torch.randn(4, 1)) for _ in range(micro_batches * 2)]
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x.to(device)), y.to(device)) / micro_batches
        loss.backward()
        losses.append(loss.item())
        if (step + 1) % micro_batches == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _result(model, losses)


def run_autocast(device: str, dtype=torch.bfloat16, steps: int = 3):
    """A mixed-precision loop. On the CPU reference, the casts CUDA's autocast policy makes
    are applied by hand: matmuls in ``dtype``; softmax and ``nll_loss`` in float32; the
    ``log_softmax`` inside ``cross_entropy`` keeps the logits' dtype (ATen passes
    ``self.scalar_type()`` explicitly, and the policy only fills in a missing dtype)."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(steps)]
    w1 = (torch.randn(16, 32) / math.sqrt(16)).to(device).requires_grad_()
    w2 = (torch.randn(32, 4) / math.sqrt(32)).to(device).requires_grad_()
    optimizer = torch.optim.SGD([w1, w2], lr=0.1)
    losses = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        if device == "cpu":
            h = torch.relu(x.to(dtype) @ w1.to(dtype))
            logits = h @ w2.to(dtype)
            loss = F.nll_loss(torch.log_softmax(logits, -1, dtype=dtype).float(), y)
            probabilities = torch.softmax(logits.float(), -1)
        else:
            with torch.autocast(device, dtype=dtype):
                h = torch.relu(x @ w1)
                logits = h @ w2
                loss = F.cross_entropy(logits, y)
                probabilities = torch.softmax(logits, -1)
        assert logits.dtype == dtype and loss.dtype == torch.float32 and probabilities.dtype == torch.float32
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [w1.detach().cpu(), w2.detach().cpu()], "grads": [w1.grad.cpu(), w2.grad.cpu()]}
