"""A fused AdamW step as one NKI kernel: every parameter of the optimizer in one launch.

``adamw(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay)``:
lists of HBM tensors (one entry per parameter); ``step`` a float32 [1] tensor on the device
that the kernel increments, so the bias corrections change every step without the kernel
changing (its non-tensor arguments are constants of its compiled form). Parameters, moments
and step are updated in place, as ``torch.optim.AdamW`` (``amsgrad=False``) updates them:

    p *= 1 - lr * weight_decay
    m += (1 - beta1) * (g - m)                 (m.lerp_(g, 1 - beta1))
    v = v * beta2 + (1 - beta2) * g * g
    p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

Each tensor is streamed as [128, n / 128] (plus a last row of the n % 128 elements left), in
2048-column tiles.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ._tiles import P, column, load, sbuf, spans

COLUMNS = 2048


def _views(t):
    """[rows, cols] views covering the tensor's elements, in order."""
    n = 1
    for size in t.shape:
        n *= size
    flat = t.reshape((n,))
    main = n // P * P
    views = []
    if main:
        whole = flat[0:main].reshape((P, main // P))
        views += [whole[:, c0:c0 + cols] for c0, cols in spans(main // P, COLUMNS)]
    if n > main:
        views.append(flat[main:n].reshape((1, n - main)))
    return views


@nki.jit
def adamw(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay):
    count = sbuf((P, 1), name="step")
    nisa.dma_copy(dst=count, src=step.reshape((1, 1)).broadcast(0, P))
    nisa.tensor_scalar(dst=count, data=count, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=step.reshape((1, 1)), src=count[0:1, :])
    # -lr / (1 - beta1^step) and sqrt(1 - beta2^step), on every partition
    neg_step_size = sbuf((P, 1))
    nisa.tensor_scalar(dst=neg_step_size, data=column(P, beta1), op0=nl.power, operand0=count, op1=nl.subtract,
                       operand1=1.0)  # beta1^step - 1
    nisa.tensor_scalar(dst=neg_step_size, data=neg_step_size, op0=nl.divide, operand0=lr, reverse0=True)
    root = sbuf((P, 1))
    nisa.tensor_scalar(dst=root, data=column(P, beta2), op0=nl.power, operand0=count, op1=nl.multiply,
                       operand1=-1.0)
    nisa.tensor_scalar(dst=root, data=root, op0=nl.add, operand0=1.0)
    nisa.activation(dst=root, op=nl.sqrt, data=root)
    for p_hbm, g_hbm, m_hbm, v_hbm in zip(params, grads, exp_avgs, exp_avg_sqs):
        for p_view, g_view, m_view, v_view in zip(_views(p_hbm), _views(g_hbm), _views(m_hbm), _views(v_hbm)):
            rows, cols = p_view.shape
            p, g = load(p_view, name="p"), load(g_view, name="g")
            m, v = load(m_view, name="m"), load(v_view, name="v")
            if weight_decay:
                nisa.tensor_scalar(dst=p, data=p, op0=nl.multiply, operand0=1.0 - lr * weight_decay)
            t = sbuf((rows, cols))
            nisa.tensor_tensor(dst=t, data1=g, data2=m, op=nl.subtract)
            nisa.scalar_tensor_tensor(dst=m, data=t, op0=nl.multiply, operand0=1.0 - beta1, op1=nl.add, operand1=m)
            nisa.tensor_tensor(dst=t, data1=g, data2=g, op=nl.multiply)
            nisa.tensor_scalar(dst=v, data=v, op0=nl.multiply, operand0=beta2)
            nisa.scalar_tensor_tensor(dst=v, data=t, op0=nl.multiply, operand0=1.0 - beta2, op1=nl.add, operand1=v)
            nisa.activation(dst=t, op=nl.sqrt, data=v)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.divide, operand0=root[:rows], op1=nl.add, operand1=eps)
            nisa.tensor_tensor(dst=t, data1=m, data2=t, op=nl.divide)
            nisa.scalar_tensor_tensor(dst=p, data=t, op0=nl.multiply, operand0=neg_step_size[:rows], op1=nl.add,
                                      operand1=p)
            for tile, view in ((p, p_view), (m, m_view), (v, v_view)):
                if view.dtype == nl.float32:
                    nisa.dma_copy(dst=view, src=tile)
                else:
                    out = sbuf((rows, cols), view.dtype)
                    nisa.tensor_copy(dst=out, src=tile)
                    nisa.dma_copy(dst=view, src=out)
