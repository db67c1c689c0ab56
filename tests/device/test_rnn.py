"""Recurrent modules on ``neuron`` against the CPU's own LSTM and GRU.

On an accelerator PyTorch's RNN composites would run each step as a fused cell kernel
(``_thnn_fused_lstm_cell``...); the device registers the composites with the CPU's branch
instead (``device/ops/rnn.py``: the CPU's cells and layers, oneDNN's LSTM layer where the CPU
uses it), so results equal the CPU's bit for bit, in float32 and bfloat16. Forward, input
and parameter gradients and a few optimizer steps are checked, in both modes.
"""
import copy

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from adaptive_eager_device.ops import rnn

pytestmark = pytest.mark.usefixtures("any_mode")

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

CONFIGS = {
    "lstm": lambda: torch.nn.LSTM(3, 5),
    "lstm_2_layers_bidirectional_batch_first": lambda: torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True,
                                                                     batch_first=True),
    "lstm_no_bias_proj": lambda: torch.nn.LSTM(3, 6, bias=False, proj_size=2),
    "gru": lambda: torch.nn.GRU(3, 5),
    "gru_3_layers_bidirectional": lambda: torch.nn.GRU(3, 4, num_layers=3, bidirectional=True),
    "gru_no_bias_batch_first": lambda: torch.nn.GRU(3, 4, bias=False, batch_first=True),
    "rnn_tanh": lambda: torch.nn.RNN(3, 4, num_layers=2),
}


def _run(build, device, x, steps=3, hidden=None):
    torch.manual_seed(0)
    module = build().to(device)
    torch.manual_seed(1)  # seeds the generator dropout draws from (the CPU's, or neuron's)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x = x.to(device).requires_grad_()
    results = []
    for _ in range(steps):
        output, state = module(x, hidden)
        state = state if isinstance(state, tuple) else (state,)
        loss = output.pow(2).sum() + sum(s.sum() for s in state)
        optimizer.zero_grad()
        x.grad = None
        loss.backward()
        optimizer.step()
        results += [output.detach(), *(s.detach() for s in state), x.grad]
    results += [p.detach() for p in module.parameters()]
    return [t.cpu() for t in results]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recurrent_modules_train_as_on_the_cpu(name):
    build = CONFIGS[name]
    batch_first = build().batch_first
    x = torch.randn(2, 7, 3) if batch_first else torch.randn(7, 2, 3)
    for a, b in zip(_run(build, "neuron", x), _run(build, "cpu", x)):
        torch.testing.assert_close(a, b, **TOLERANCE)


def test_dropout_between_layers_draws_as_on_the_cpu():
    build = lambda: torch.nn.LSTM(3, 5, num_layers=3, dropout=0.4)  # noqa: E731
    x = torch.randn(6, 2, 3)
    for a, b in zip(_run(build, "neuron", x), _run(build, "cpu", x)):
        torch.testing.assert_close(a, b, **TOLERANCE)


@pytest.mark.parametrize("cell", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_cells_forward_and_backward(cell):
    def run(device):
        torch.manual_seed(0)
        module = cell(4, 6).to(device)
        x = torch.randn(3, 4).to(device).requires_grad_()
        state = None
        outputs = []
        for _ in range(4):  # unrolled by hand, as users write it
            state = module(x, state)
            outputs.append(state[0] if isinstance(state, tuple) else state)
        torch.stack(outputs).sum().backward()
        return [t.detach().cpu() for t in outputs] + [x.grad.cpu()] + [p.grad.cpu() for p in module.parameters()]

    for a, b in zip(run("neuron"), run("cpu")):
        torch.testing.assert_close(a, b, **TOLERANCE)


@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU])
def test_packed_sequences(kind):
    """``pack_padded_sequence`` takes its lengths on the CPU, as on every accelerator."""
    lengths = torch.tensor([5, 3, 2])

    def run(device):
        torch.manual_seed(0)
        module = kind(3, 4, batch_first=True, bidirectional=True).to(device)
        x = torch.randn(3, 5, 3).to(device).requires_grad_()
        packed = pack_padded_sequence(x, lengths, batch_first=True)
        output, _ = module(packed)
        padded, out_lengths = pad_packed_sequence(output, batch_first=True)
        padded.sum().backward()
        assert out_lengths.tolist() == lengths.tolist()
        return [padded.detach().cpu(), x.grad.cpu()] + [p.grad.cpu() for p in module.parameters()]

    for a, b in zip(run("neuron"), run("cpu")):
        torch.testing.assert_close(a, b, **TOLERANCE)




@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU])
def test_a_module_that_ran_on_the_cpu_moves_to_the_device(kind):
    """An RNN that ran on the CPU holds references to its flat weights; ``.to('neuron')``
    must still move it, keeping each Parameter the same object."""
    torch.manual_seed(0)
    module = kind(3, 4, num_layers=2)
    x = torch.randn(5, 2, 3)
    expected = module(x)[0]
    before = list(module.parameters())
    module.to("neuron")
    assert all(p is q for p, q in zip(module.parameters(), before))
    assert all(p.device.type == "neuron" for p in module.parameters())
    assert all(w.device.type == "neuron" for w in module._flat_weights)
    torch.testing.assert_close(module(x.to("neuron"))[0].cpu(), expected.detach(), **TOLERANCE)
    module.to("cpu")
    torch.testing.assert_close(module(x)[0], expected, **TOLERANCE)


def _one_step(module, device, x, lengths):
    """Outputs, final states and the gradients of inputs and parameters, on the CPU; with
    ``lengths`` (the last one's, 0 for the full length), as a packed sequence."""
    module = copy.deepcopy(module).to(device)
    x = x.to(device).requires_grad_()
    steps = x.size(int(module.batch_first))
    inputs = x if lengths is None else pack_padded_sequence(
        x, torch.tensor([steps, lengths or steps]), module.batch_first)
    output, state = module(inputs)
    output = output if lengths is None else output.data
    state = state if isinstance(state, tuple) else (state,)
    loss = (output * output).sum() + sum((s * s).sum() for s in state)
    return [t.detach().cpu() for t in (output, *state, *torch.autograd.grad(loss, [x, *module.parameters()]))]


@pytest.mark.parametrize("lengths", [None, 2, 0], ids=["padded", "packed", "packed_one_length"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bfloat16_layers_equal_the_cpu_bit_for_bit(name, lengths):
    # The fused cells rounded the gates apart from the matmuls (and oneDNN's LSTM, which
    # the CPU runs on a padded batch or a packed one of sequences of one length, keeps
    # them in float32): a step or two of bfloat16 off the CPU's.
    torch.manual_seed(0)
    module = CONFIGS[name]().to(torch.bfloat16)
    x = torch.randn(2, 7, 3) if module.batch_first else torch.randn(7, 2, 3)
    x = x.to(torch.bfloat16)
    for a, b in zip(_one_step(module, "neuron", x, lengths), _one_step(module, "cpu", x, lengths)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cell", [torch.nn.LSTMCell, torch.nn.GRUCell])
def test_cells_equal_the_cpu_bit_for_bit(cell, dtype):
    torch.manual_seed(0)
    module, x = cell(4, 6).to(dtype), torch.randn(3, 4, dtype=dtype)

    def run(device):
        moved, inputs = copy.deepcopy(module).to(device), x.to(device).requires_grad_()
        out = moved(inputs)
        out = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(sum((o * o).sum() for o in out), [inputs, *moved.parameters()])
        return [t.detach().cpu() for t in (*out, *grads)]

    for a, b in zip(run("neuron"), run("cpu")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_branch_written_out_is_the_cpus(op, dtype):
    # device/ops/rnn.py on CPU tensors: PyTorch's own composite (and oneDNN's LSTM), exactly,
    # forward and backward, bidirectional and stacked, with and without biases.
    torch.manual_seed(0)
    for bias in (True, False):
        module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN}[op](
            3, 5, num_layers=2, bidirectional=True, bias=bias).to(dtype)
        weights = [w.detach().clone().requires_grad_() for w in module._flat_weights]
        x = torch.randn(4, 2, 3, dtype=dtype, requires_grad=True)
        hx = [torch.randn(4, 2, 5, dtype=dtype, requires_grad=True) for _ in range(2 if op == "lstm" else 1)]
        args = (x, hx if op == "lstm" else hx[0], weights, bias, 2, 0.0, True, True, False)
        expected, result = getattr(torch.ops.aten, op).input(*args), getattr(rnn, f"{op}_input")(*args)
        cotangents = [torch.randn_like(t) for t in expected]
        leaves = [x, *hx, *weights]
        expected_grads = torch.autograd.grad(expected, leaves, cotangents)
        result_grads = torch.autograd.grad(result, leaves, cotangents)
        for a, b in zip([*result, *result_grads], [*expected, *expected_grads]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU])
def test_a_hidden_state_on_another_device_is_refused_as_on_the_cpu(kind):
    module = kind(3, 4).to("neuron")
    h = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="Input and hidden tensors are not at the same device"):
        module(torch.randn(5, 2, 3).to("neuron"), (h, h) if kind is torch.nn.LSTM else h)
