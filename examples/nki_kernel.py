"""Write an NKI kernel, call it on neuron tensors, register it as a PyTorch operator, train with
it, compile it, and use the kernel library: the README's example.

    python examples/nki_kernel.py

Prints what each call launched and its simulated device time, and exits 1 if a result differs
from plain PyTorch on the CPU.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import adaptive_eager
import nki
import nki.isa as nisa
import nki.language as nl
from adaptive_eager import kernels
from torch_neuronx import nki_op


@nki.jit
def scale_rows(x, w):
    """out[i, :] = x[i, :] * w[i] for x [N, F], w [N, 1]: 128-row tiles, a per-partition scalar."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(x.shape[0] // nl.tile_size.pmax):
        rows = slice(i * 128, (i + 1) * 128)
        t = nl.ndarray((128, x.shape[1]), x.dtype, buffer=nl.sbuf)
        s = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[rows, :])
        nisa.dma_copy(dst=s, src=w[rows, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=s)
        nisa.dma_copy(dst=out[rows, :], src=t)
    return out


@nki_op("example::scale_rows", mutates_args=())
def scale_rows_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return scale_rows(x, w)


def _scale_rows_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return scale_rows_op(grad, w), (grad * x).sum(1, keepdim=True)


scale_rows_op.register_autograd(_scale_rows_backward,
                                setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))

failures = []


def report(what, expected, got, tol=1e-5):
    torch.neuron.synchronize()
    stats = adaptive_eager.stats()
    ours = {k: v["launches"] for k, v in stats["kernels"].items()}
    ok = torch.allclose(got.detach().cpu(), expected.detach(), rtol=tol, atol=tol)
    failures.extend([] if ok else [what])
    print(f"{what:<44} {'equal' if ok else 'DIFFERS'}: {stats['kernels_launched']} launches, "
          f"{stats['device_time_us']:.1f} us simulated  {ours}")
    adaptive_eager.reset_stats()


x, w = torch.randn(256, 64), torch.randn(256, 1)
xd, wd = x.to("neuron"), w.to("neuron")
torch.neuron.synchronize()
adaptive_eager.reset_stats()

report("the kernel on neuron tensors", x * w, scale_rows(xd, wd))
print(f"{'':<44} nki.run on numpy: {nki.run(scale_rows, x.numpy(), w.numpy()).time_us:.1f} us")

xg = xd.clone().requires_grad_()
scale_rows_op(xg, wd).sum().backward()
report("nki_op forward and backward (x's grad)", w.expand(256, 64), xg.grad)

compiled = torch.compile(lambda x, w: scale_rows_op(x, w).relu(), backend="neuron")
report("torch.compile: the op is one node", (x * w).relu(), compiled(xd, wd))

h, weight, logits, target = torch.randn(4, 32, 128), torch.randn(128), torch.randn(64, 1000), torch.randint(0, 1000, (64,))
hd, weightd, logitsd, targetd = (t.to("neuron") for t in (h, weight, logits, target))
torch.neuron.synchronize()
adaptive_eager.reset_stats()
reference = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
report("the library's RMSNorm", reference, kernels.rms_norm(hd, weightd))
report("the library's cross-entropy", F.cross_entropy(logits, target), kernels.cross_entropy(logitsd, targetd))

sys.exit(1 if failures else 0)
