"""Kernels an accelerator has and the CPU lacks: the device implements them itself.

Entry point: :data:`DEVICE_REWRITES` (aten op -> the ``neuron::`` op the dispatcher runs
instead: same arguments, a CPU implementation written in aten ops, and a meta kernel).

On an accelerator, PyTorch's own code calls kernels that exist only for accelerators:
the RNN composites (``aten::lstm``, ``gru``, ``lstm_cell``, ``gru_cell``) call the fused
cells ``aten::_thnn_fused_lstm_cell`` and ``aten::_thnn_fused_gru_cell`` (and their
backward kernels) whenever the input is not on the CPU. The CPU has no kernel for them,
so the device runs these: the gate arithmetic of CUDA's kernels (``aten/src/ATen/native/
cuda/RNN.cu``), in the inputs' dtype. Eager ``nn.LSTM``/``nn.GRU`` and the cells no
longer reach them: the device registers those composites with the CPU's branch
(``device/ops/rnn.py``), whose results equal the CPU's bit for bit; the fused cells remain
for graphs that call them (``torch.compile`` decomposes the composites above the device
as for any accelerator) and direct calls, within float tolerance of the CPU's LSTM and
GRU (the CPU adds the biases inside its matmuls).
"""
from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("neuron", "FRAGMENT")


def _define(name: str, schema: str, cpu, meta):
    _LIBRARY.define(f"{name}{schema}")
    _LIBRARY.impl(name, cpu, "CPU")
    _LIBRARY.impl(name, meta, "Meta")
    return getattr(torch.ops.neuron, name).default


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
        gates = gates + hidden_bias
    return gates


# -- LSTM ---------------------------------------------------------------------------------
def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace): workspace holds the activated gates, for backward."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(input_gates)


def _lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad of the gates, grad of cx, grad of the bias or None)."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_o = grad_hy * tanh_cy if grad_hy is not None else torch.zeros_like(cy)
    grad_c = (grad_hy * o * (1 - tanh_cy * tanh_cy)) if grad_hy is not None else torch.zeros_like(cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_i = grad_c * g * (1 - i) * i
    grad_f = grad_c * cx * (1 - f) * f
    grad_g = grad_c * i * (1 - g * g)
    grad_o = grad_o * (1 - o) * o
    grad_gates = torch.cat([grad_i, grad_f, grad_g, grad_o], 1)
    return grad_gates, grad_c * f, grad_gates.sum(0) if has_bias else None


def _lstm_cell_backward_meta(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    bias = workspace.new_empty(workspace.shape[1]) if has_bias else None
    return torch.empty_like(workspace), torch.empty_like(cx), bias


# -- GRU ----------------------------------------------------------------------------------
def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace): workspace holds r, z, n, hx and the hidden part of n, for backward."""
    ir, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    if input_bias is not None:
        b1r, b1i, b1n = input_bias.chunk(3)
        b2r, b2i, b2n = hidden_bias.chunk(3)
        r = (ir + hr + b1r + b2r).sigmoid()
        z = (ii + hi + b1i + b2i).sigmoid()
        hn = hn + b2n
        n = (in_ + b1n + r * hn).tanh()
    else:
        r = (ir + hr).sigmoid()
        z = (ii + hi).sigmoid()
        n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    return torch.empty_like(hx), hx.new_empty((hx.shape[0], hx.shape[1] * 5))


def _gru_cell_backward(grad_hy, workspace, has_bias):
    """(grad of input gates, grad of hidden gates, grad of hx, grads of the two biases)."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_hx = grad_hy * z
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_hn = grad_n * r
    grad_r = grad_n * hn * (1 - r) * r
    grad_input = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_hn], 1)
    if has_bias:
        return grad_input, grad_hidden, grad_hx, grad_input.sum(0), grad_hidden.sum(0)
    return grad_input, grad_hidden, grad_hx, None, None


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    gates = grad_hy.new_empty((grad_hy.shape[0], grad_hy.shape[1] * 3))
    bias = grad_hy.new_empty(grad_hy.shape[1] * 3) if has_bias else None
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, None if bias is None else torch.empty_like(bias)


_aten = torch.ops.aten
DEVICE_REWRITES = {
    _aten._thnn_fused_lstm_cell.default: _define(
        "thnn_fused_lstm_cell",
        "(Tensor input_gates, Tensor hidden_gates, Tensor cx, Tensor? input_bias=None, Tensor? hidden_bias=None)"
        " -> (Tensor, Tensor, Tensor)", _lstm_cell, _lstm_cell_meta),
    _aten._thnn_fused_lstm_cell_backward_impl.default: _define(
        "thnn_fused_lstm_cell_backward_impl",
        "(Tensor? grad_hy, Tensor? grad_cy, Tensor cx, Tensor cy, Tensor workspace, bool has_bias)"
        " -> (Tensor, Tensor, Tensor?)", _lstm_cell_backward, _lstm_cell_backward_meta),
    _aten._thnn_fused_gru_cell.default: _define(
        "thnn_fused_gru_cell",
        "(Tensor input_gates, Tensor hidden_gates, Tensor hx, Tensor? input_bias=None, Tensor? hidden_bias=None)"
        " -> (Tensor, Tensor)", _gru_cell, _gru_cell_meta),
    _aten._thnn_fused_gru_cell_backward.default: _define(
        "thnn_fused_gru_cell_backward",
        "(Tensor grad_hy, Tensor workspace, bool has_bias) -> (Tensor, Tensor, Tensor, Tensor?, Tensor?)",
        _gru_cell_backward, _gru_cell_backward_meta),
}
