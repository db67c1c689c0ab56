"""The floor a Python-level device is read against: a thin pass-through
``__torch_dispatch__`` tensor wrapper subclass (bench only, never shipped).

Each op on a :class:`PassThrough` tensor unwraps its arguments, runs the CPU op and wraps
the tensor it returns; nothing else (no tree_map, no metadata checks, no recording). So a
program run through it pays exactly what any ``__torch_dispatch__`` device pays before it
does any work of its own: PyTorch's dispatch to Python, the call, one wrapper tensor per
result. ``neuron``'s host cost per op in strict and adaptive mode is read against it
(``python -m bench --wrapper``, ``bench/measure.py``).

:func:`build_wrapped` builds a workload of ``bench/workloads.py`` unchanged: it is built
for ``"cpu"`` while a torch function mode wraps what ``Tensor.to`` returns (so
``model.to(device)`` makes every parameter and buffer a wrapper, and the optimizer is
built over them). The mode is only active while building; in the step, tensors the
program makes on the host (``x.to(device)`` of a CPU batch, ``torch.arange``) stay plain
CPU tensors, and the first op that meets a wrapper wraps its result, as a device's first
op would make a device tensor. Ops that touch no wrapped tensor run as plain CPU eager:
a factory naming ``device=x.device`` (the wrapper's device is the CPU) and its chain (the
causal mask), AdamW's step counters (CPU tensors on any device) and profiler markers: 11%
of the GPT step's ops, 8% of Llama's, none of the decode loop's
(``tests/benchmarks/test_wrapper_bench.py``). The step runs the CPU's program: PyTorch's optimizers pick
their ``foreach`` implementations for accelerators only, so AdamW runs per parameter here
as on CPU eager, while on ``neuron`` it runs ``_foreach_*`` ops (the ``ops`` column says
how many ops each mode ran; host us per op is comparable, wall per step is that program's).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode


class PassThrough(torch.Tensor):
    """Unwrap, run on the CPU, wrap. A traceable wrapper subclass (``__tensor_flatten__``),
    so ``module.to`` swaps it into each ``Parameter``, as it does a DTensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device=elem.device,
        )
        wrapper.elem = elem
        return wrapper

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return PassThrough(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = [a.elem if type(a) is PassThrough else (_unwrap(a) if type(a) in _SEQUENCES else a) for a in args]
        if kwargs:
            kwargs = {k: (v.elem if type(v) is PassThrough else _unwrap(v)) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
        else:
            out = func(*args)
        if isinstance(out, torch.Tensor):
            return PassThrough(out)
        if type(out) in (tuple, list):
            return type(out)(PassThrough(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out


_SEQUENCES = (list, tuple)


def _unwrap(value):
    """A tensor list's wrappers unwrapped (``cat``, ``_foreach_*``); anything else as it is."""
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(v.elem if type(v) is PassThrough else v for v in value)
    return value


class _WrapOnTo(TorchFunctionMode):
    """While a workload is built: what ``Tensor.to`` returns becomes a wrapper."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and type(out) is not PassThrough:
            return PassThrough(out.detach())
        return out


def build_wrapped(workload) -> Callable[[], torch.Tensor]:
    """``workload.build`` on the CPU with its parameters, buffers and state wrapped."""
    with _WrapOnTo():
        return workload.build("cpu")


def unwrap(value: torch.Tensor) -> torch.Tensor:
    """The plain CPU tensor a step's wrapped result stands for."""
    return value.elem if type(value) is PassThrough else value
