"""``torch_neuronx.nki_op``: an NKI kernel as a PyTorch custom operator, as TorchNeuron's guide
("How to work with NKI kernels from torch-neuronx") describes.

``@nki_op("mylib::op", mutates_args=...)`` decorates a typed wrapper whose body calls ``@nki.jit``
kernels. It is ``torch.library.custom_op`` (the wrapper's annotations give the schema;
``mutates_args`` names the tensors the kernel updates in place; the result has
``register_autograd``, ``register_kernel``, ``register_fake``...) with the fake kernel filled in:
the wrapper itself, run on FakeTensors, whose kernel calls take their output shapes from the
kernel (its trial, ``nki/_torch.py``). So the operator works in eager mode (on neuron tensors its
kernel calls are one launch each; on CPU tensors the kernels run on the simulator), under
autograd with ``register_autograd``, and inside ``torch.compile(backend="neuron")`` as one node of
the captured graph.
"""
from __future__ import annotations

import functools

import torch


def nki_op(name: str, fn=None, /, *, mutates_args, device_types=None, schema=None, tags=None):
    """Register ``fn`` (a wrapper calling NKI kernels, with type annotations) as the custom
    operator ``name`` ("namespace::op"). Used as ``@nki_op("mylib::op", mutates_args=())``.
    Returns ``torch.library.CustomOpDef``: call it, or ``torch.ops.namespace.op``."""

    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args, device_types=device_types, schema=schema,
                                     tags=tags)(fn)

        @functools.wraps(fn)
        def fake(*args, **kwargs):  # the kernels' own shapes: their calls on FakeTensors
            return fn(*args, **kwargs)

        op.register_fake(fake)
        return op

    return register if fn is None else register(fn)
