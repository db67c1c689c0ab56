"""Recurrent layers and cells on ``neuron`` compute what the CPU's compute.

Entry point: :func:`register` (called once by ``backend._register_kernels``).

``aten::lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu`` and the ``lstm_cell``/``gru_cell``
ops are ``CompositeImplicitAutograd`` composites whose C++ body branches on the device
(``aten/src/ATen/native/RNN.cpp``): on an accelerator (``is_privateuseone()``) each step
is one fused cell kernel fed by bias-free matmuls (``_thnn_fused_lstm_cell``,
``device/ops/native.py``), on the CPU the biases go into the matmuls (``linear``), the input
projection of a whole layer is one matmul ahead of the steps, and an LSTM runs as oneDNN's
layer kernel (``mkldnn_rnn_layer``) whenever oneDNN takes the dtype. In bfloat16 those
round differently, by a step or two.

So the device registers these ops at AutogradPrivateUse1 with the CPU's branch, written
in the same aten ops in the same order (autograd records them as it does on the CPU): the
generic layers (``_layer``, ``_bidirectional_layer``, the packed ones) with the CPU's cells
(``_lstm_step``, ``_gru_step``, ``_simple_step``), and for an LSTM that oneDNN takes the
layer kernel itself (``_lstm_onednn``), which the device runs as the CPU runs it. Run on
CPU tensors, each function here gives the CPU's results bit for bit
(``tests/device/test_rnn.py``).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_LSTM_MODE = 2  # ideep::rnn_kind::LSTM, mkldnn_rnn_layer's ``mode``


# -- cells (RNN.cpp: SimpleCell, LSTMCell and GRUCell, their CPU branch) ------------------
def _linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


def _lstm_step(x, hidden, params, projected=False):
    w_ih, w_hh, b_ih, b_hh, w_hr = params
    hx, cx = hidden
    gates = _linear(hx, w_hh, b_hh).add_(x if projected else _linear(x, w_ih, b_ih))
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate, forgetgate = ingate.sigmoid_(), forgetgate.sigmoid_()
    cellgate, outgate = cellgate.tanh_(), outgate.sigmoid_()
    cy = (forgetgate * cx).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    if w_hr is not None:
        hy = torch.matmul(hy, w_hr.t())
    return hy, cy


def _gru_step(x, hidden, params, projected=False):
    w_ih, w_hh, b_ih, b_hh, _ = params
    input_gates = (x if projected else _linear(x, w_ih, b_ih)).unsafe_chunk(3, 1)
    hidden_gates = _linear(hidden, w_hh, b_hh).unsafe_chunk(3, 1)
    reset = hidden_gates[0].add_(input_gates[0]).sigmoid_()
    update = hidden_gates[1].add_(input_gates[1]).sigmoid_()
    new = input_gates[2].add(hidden_gates[2].mul_(reset)).tanh_()
    return (hidden - new).mul_(update).add_(new)


def _simple_step(nonlinearity):
    def step(x, hidden, params, projected=False):
        w_ih, w_hh, b_ih, b_hh, _ = params
        return nonlinearity(_linear(hidden, w_hh, b_hh).add_(x if projected else _linear(x, w_ih, b_ih)))
    return step


def _output_of(hidden):
    return hidden[0] if isinstance(hidden, tuple) else hidden


# -- layers (RNN.cpp: FullLayer, FullBidirectionalLayer, PackedLayer...; CPU branch) -------
def _steps(cell, step_inputs, hidden, params):
    outputs = []
    for x in step_inputs:
        hidden = cell(x, hidden, params, True)
        outputs.append(_output_of(hidden))
    if not outputs:
        raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
    return outputs, hidden


def _layer(cell, inputs, hidden, params):
    outputs, hidden = _steps(cell, _linear(inputs, params[0], params[2]).unbind(0), hidden, params)
    return torch.stack(outputs, 0), hidden


def _bidirectional_layer(cell, inputs, hidden, params):
    forward, backward = params
    fw_outputs, fw_hidden = _steps(cell, _linear(inputs, forward[0], forward[2]).unbind(0), hidden[0], forward)
    fw_output = torch.stack(fw_outputs, 0)
    rev_outputs, rev_hidden = _steps(cell, _linear(inputs, backward[0], backward[2]).unbind(0)[::-1], hidden[1], backward)
    rev_output = torch.stack(rev_outputs[::-1], 0)
    return torch.cat([fw_output, rev_output], fw_output.dim() - 1), (fw_hidden, rev_hidden)


def _slice(hidden, start, end):
    if isinstance(hidden, tuple):
        return tuple(h.narrow(0, start, end - start) for h in hidden)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens):
    if isinstance(hiddens[0], tuple):
        return tuple(torch.cat([h[i] for h in hiddens], 0) for i in range(len(hiddens[0])))
    return torch.cat(hiddens, 0)


def _packed_layer(cell, packed, hidden, params):
    data, batch_sizes = packed
    projected, sizes = _linear(data, params[0], params[2]), batch_sizes.tolist()
    outputs, finished, offset, last = [], [], 0, sizes[0]
    for batch in sizes:
        x = projected.narrow(0, offset, batch)
        offset += batch
        if last - batch > 0:
            finished.append(_slice(hidden, batch, last))
            hidden = _slice(hidden, 0, batch)
        last = batch
        hidden = cell(x, hidden, params, True)
        outputs.append(_output_of(hidden))
    finished.append(hidden)
    return (torch.cat(outputs, 0), batch_sizes), _concat(finished[::-1])


def _reversed_packed_layer(cell, packed, input_hidden, params):
    data, batch_sizes = packed
    projected, sizes = _linear(data, params[0], params[2]), batch_sizes.tolist()
    outputs, offset, last = [], data.size(0), sizes[-1]
    hidden = _slice(input_hidden, 0, last)
    for batch in reversed(sizes):
        if batch - last > 0:
            hidden = _concat([hidden, _slice(input_hidden, last, batch)])
        x = projected.narrow(0, offset - batch, batch)
        offset -= batch
        last = batch
        hidden = cell(x, hidden, params, True)
        outputs.append(_output_of(hidden))
    return (torch.cat(outputs[::-1], 0), batch_sizes), hidden


def _packed_bidirectional_layer(cell, packed, hidden, params):
    (fw_data, batch_sizes), fw_hidden = _packed_layer(cell, packed, hidden[0], params[0])
    (rev_data, _), rev_hidden = _reversed_packed_layer(cell, packed, hidden[1], params[1])
    return (torch.cat([fw_data, rev_data], -1), batch_sizes), (fw_hidden, rev_hidden)


def _dropout(value, p):
    if isinstance(value, tuple):  # a packed sequence: (data, batch sizes)
        return torch.dropout(value[0], p, True), value[1]
    return torch.dropout(value, p, True)


def _stack_layers(cell, layer, inputs, hiddens, params, num_layers, dropout_p, train, bidirectional):
    """RNN.cpp's ``_rnn_impl``: the layers in turn, dropout between them; the final
    hidden states in the order the parameters come."""
    if bidirectional:
        hiddens = list(zip(hiddens[0::2], hiddens[1::2]))
        params = list(zip(params[0::2], params[1::2]))
    if num_layers != len(hiddens):
        raise RuntimeError("Expected more hidden states in stacked_rnn")
    finals = []
    for index in range(num_layers):
        inputs, final = layer(cell, inputs, hiddens[index], params[index])
        finals += list(final) if bidirectional else [final]
        if dropout_p != 0 and train and index < num_layers - 1:
            inputs = _dropout(inputs, dropout_p)
    return inputs, finals


def _gather_params(params, has_biases, has_projections=False):
    """RNN.cpp's ``gather_params``: (w_ih, w_hh, b_ih, b_hh, w_hr) per layer and direction."""
    size = (4 if has_biases else 2) + (1 if has_projections else 0)
    if len(params) % size:
        raise RuntimeError("got an incorrect number of RNN parameters")
    groups = [params[i:i + size] for i in range(0, len(params), size)]
    if has_biases:
        return [(g[0], g[1], g[2], g[3], g[4] if has_projections else None) for g in groups]
    return [(g[0], g[1], None, None, g[2] if has_projections else None) for g in groups]


def _layers(packed, bidirectional):
    if packed:
        return _packed_bidirectional_layer if bidirectional else _packed_layer
    return _bidirectional_layer if bidirectional else _layer


# -- oneDNN's LSTM (mkldnn/RNN.cpp: mkldnn_rnn), what the CPU runs when oneDNN takes it ---
def _onednn_takes(input, hx) -> bool:
    """RNN.cpp's ``use_mkldnn`` for an LSTM's tensors (on the device rather than the CPU),
    without projections (``lstm`` then falls back to the generic layers)."""
    if not torch._C._get_mkldnn_enabled() or input.numel() == 0 or hx[0].size(2) != hx[1].size(2):
        return False
    if input.dtype == torch.float32:
        return True
    if input.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return input.dtype == torch.float16 and not torch.is_grad_enabled() and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _lstm_onednn(input, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, batch_first):
    if batch_first:
        input = input.transpose(0, 1)
    layer_input, h0, c0 = input.contiguous(), hx[0].contiguous(), hx[1].contiguous()
    stride = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    hidden_size = h0.size(2)
    hy, cy = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = params[index * stride:(index + 1) * stride]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            output, h, c, _ = aten.mkldnn_rnn_layer(
                layer_input, w[0], w[1], b_ih, b_hh, h0[index], c0[index], direction > 0, [], _LSTM_MODE, hidden_size,
                num_layers, has_biases, bidirectional, batch_first, train)
            outputs.append(output)
            hy.append(h)
            cy.append(c)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


# -- the ops -------------------------------------------------------------------------------
def _check_devices(input, hiddens, params):
    """RNN.cpp's ``check_attributes``: the hidden states and parameters on the input's device."""
    for name, tensors in (("hidden", hiddens), ("parameter", params)):
        for t in tensors:
            if t is not None and t.device != input.device:
                raise RuntimeError(f"Input and {name} tensors are not at the same device, found input tensor at "
                                   f"{input.device} and {name} tensor at {t.device}")


def lstm_input(input, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, batch_first):
    if len(hx) != 2:
        raise RuntimeError("lstm expects two hidden states")
    _check_devices(input, hx, params)
    if _onednn_takes(input, hx):
        return _lstm_onednn(input, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, batch_first)
    inputs = input.transpose(0, 1) if batch_first else input
    output, hy, cy = _lstm(inputs, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, packed=False)
    return (output.transpose(0, 1) if batch_first else output), hy, cy


def lstm_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout_p, train, bidirectional):
    if len(hx) != 2:
        raise RuntimeError("lstm expects two hidden states")
    sizes = batch_sizes.tolist()
    if sizes and sizes[0] == sizes[-1] and _onednn_takes(data, hx):  # sequences of one length: a padded batch
        output, hy, cy = _lstm_onednn(data.view(len(sizes), sizes[0], data.size(-1)), hx, params, has_biases,
                                      num_layers, dropout_p, train, bidirectional, False)
        return output.reshape(data.size(0), output.size(-1)), hy, cy
    (output, _), hy, cy = _lstm((data, batch_sizes), hx, params, has_biases, num_layers, dropout_p, train,
                                bidirectional, packed=True)
    return output, hy, cy


def _lstm(inputs, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, packed):
    """RNN.cpp's ``_lstm_impl``: (h, c) pairs per layer and direction, stacked back."""
    projections = hx[0].size(2) != hx[1].size(2)
    hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
    output, finals = _stack_layers(_lstm_step, _layers(packed, bidirectional), inputs, hiddens,
                                   _gather_params(params, has_biases, projections), num_layers, dropout_p, train,
                                   bidirectional)
    return output, torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)


def _one_hidden(cell):
    """``gru``, ``rnn_tanh``, ``rnn_relu`` (RNN.cpp's ``ONE_HIDDEN_RNN``): .input and .data."""
    def on_input(input, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, batch_first):
        _check_devices(input, [hx], params)
        inputs = input.transpose(0, 1) if batch_first else input
        output, finals = _stack_layers(cell, _layers(False, bidirectional), inputs, hx.unbind(0),
                                       _gather_params(params, has_biases), num_layers, dropout_p, train, bidirectional)
        if batch_first:
            output.transpose_(0, 1)
        return output, torch.stack(finals, 0)

    def on_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout_p, train, bidirectional):
        (output, _), finals = _stack_layers(cell, _layers(True, bidirectional), (data, batch_sizes), hx.unbind(0),
                                            _gather_params(params, has_biases), num_layers, dropout_p, train,
                                            bidirectional)
        return output, torch.stack(finals, 0)

    return on_input, on_data


def _check_cell(input, hiddens, w_ih, w_hh, gates):
    """RNN.cpp's checks of a cell's arguments, with its messages."""
    hidden_size = w_hh.size(1)
    if input.size(1) != w_ih.size(1):
        raise RuntimeError(f"input has inconsistent input_size: got {input.size(1)} expected {w_ih.size(1)}")
    for name, weight in (("weight_ih", w_ih), ("weight_hh", w_hh)):
        if weight.size(0) != gates * hidden_size:
            raise RuntimeError(f"{name} first dim must be {gates} * hidden_size = {gates * hidden_size}, "
                               f"but got {weight.size(0)}")
    for label, hx in enumerate(hiddens):
        if input.size(0) != hx.size(0):
            raise RuntimeError(f"Input batch size {input.size(0)} doesn't match hidden{label} batch size {hx.size(0)}")
        if hx.size(1) != hidden_size:
            raise RuntimeError(f"hidden{label} has inconsistent hidden_size: got {hx.size(1)}, expected {hidden_size}")


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    if len(hx) != 2:
        raise RuntimeError("lstm_cell expects two hidden states")
    _check_cell(input, hx, w_ih, w_hh, 4)
    return _lstm_step(input, (hx[0], hx[1]), (w_ih, w_hh, b_ih, b_hh, None))


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    _check_cell(input, [hx], w_ih, w_hh, 3)
    return _gru_step(input, hx, (w_ih, w_hh, b_ih, b_hh, None))


gru_input, gru_data = _one_hidden(_gru_step)
rnn_tanh_input, rnn_tanh_data = _one_hidden(_simple_step(torch.tanh))
rnn_relu_input, rnn_relu_data = _one_hidden(_simple_step(torch.relu))
KERNELS = {
    "lstm.input": lstm_input, "lstm.data": lstm_data, "gru.input": gru_input, "gru.data": gru_data,
    "rnn_tanh.input": rnn_tanh_input, "rnn_tanh.data": rnn_tanh_data,
    "rnn_relu.input": rnn_relu_input, "rnn_relu.data": rnn_relu_data,
    "lstm_cell": lstm_cell, "gru_cell": gru_cell,
}


def register(library: torch.library.Library) -> None:
    """Register the kernels above in ``library`` (an ``aten`` IMPL library)."""
    for name, kernel in KERNELS.items():
        library.impl(name, kernel, "AutogradPrivateUse1")
