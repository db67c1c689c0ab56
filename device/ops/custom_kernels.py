"""Custom kernels: device kernels written outside ATen (NKI kernels), one opaque launch each.

Entry points: :class:`KernelForm` (what the device asks of one kernel called one way),
:func:`register_form`, :func:`kernel_op` (the ``OpOverload`` a call goes through) and
:func:`is_custom_kernel` (the planner's test).

A custom kernel call is an op like any other on its way to the queue:
``torch.ops.nki.<kernel name>(tensor, ..., form)``, its tensors and one ``int`` naming its
*form* (:data:`FORMS`): the kernel with the call's non-tensor arguments, which select its
program, as TorchNeuron compiles a kernel once per input shapes, dtypes and non-tensor argument
values. So recording (the signature keeps the form's number), the shape cache, the strict
sink, the adaptive window, compiled mode's graphs and replay, the failure rules (a failing
kernel's error is deferred to the next sync point and names the op and the user's line) and
the statistics (``stats()["kernels"]`` by the op's name) are the per-op path's, unchanged.
What is the kernel's own:

- output metadata: the form's :meth:`KernelForm.infer`, on meta or fake tensors (the op's
  fake kernel, so FakeTensor and ``torch.compile`` see the kernel's shapes too);
- its cost: :meth:`KernelForm.device_us` (``cost_model.KERNEL_TIMES``: the NKI schedule
  in place of the engine model's estimate for an aten op), plus the launch the queue adds;
- its execution on the device worker: :meth:`KernelForm.run` on the CPU tensors holding the
  storages' bytes (the op's CPU kernel, which the worker calls as it calls any op's);
- fusion: the planner never puts it in a kernel with another op (``fusion/categories.py``).

Which tensors a kernel writes is part of its op's schema (``Tensor(a!)``), so the window
orders it against their readers and writers, and compiled mode functionalizes it. One op is
defined per kernel name, tensor count and written positions, in the ``nki`` namespace.
"""
from __future__ import annotations

import re

import torch

from ..core.errors import user_facing
from ..hardware import cost_model
from ..hardware.execution_queue import HOST_LOCK
from ..memory.indices import MULTI
from .device_guard import on_its_device
from .dispatch import run
from .op_table import op_entry

NAMESPACE = "nki"
_LIBRARY = None
_OPS: dict = {}  # (name, count, written) -> OpOverload
_OVERLOADS: dict = {}  # name -> overloads defined so far
CUSTOM_KERNEL_OPS: set = set()  # every OpOverload defined here (fusion's KERNEL category)
FORMS: dict = {}  # form number -> KernelForm


class KernelForm:
    """One kernel called one way (its non-tensor arguments fixed). Subclasses answer:

    - :meth:`infer`: ``[(shape, torch dtype), ...]`` of the fresh outputs, from the
      input tensors' metadata (meta or fake tensors); raises what the host can see;
    - :meth:`device_us`: the kernel's device time for those inputs, without the launch;
    - :meth:`run`: on the device worker, the kernel on CPU tensors (the storages' bytes; a
      written input is written in place), returning its fresh outputs.
    """

    name = "kernel"
    number = 0

    def infer(self, tensors) -> list:
        raise NotImplementedError

    def device_us(self, tensors) -> float:
        raise NotImplementedError

    def run(self, tensors) -> list:
        raise NotImplementedError


def register_form(form: KernelForm) -> int:
    """Give ``form`` its number (the ``int`` argument of its calls); forms are kept for the
    process's lifetime, as a compiled kernel cache."""
    number = len(FORMS) + 1
    form.number = number
    FORMS[number] = form
    return number


def is_custom_kernel(op) -> bool:
    return op in CUSTOM_KERNEL_OPS


def _library():
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _LIBRARY


def _op_name(name: str) -> str:
    name = re.sub(r"\W", "_", name) or "kernel"
    return name if not name[0].isdigit() else "k_" + name


def kernel_op(name: str, count: int, written: tuple):
    """The op of a kernel named ``name`` taking ``count`` tensors, writing those whose
    ``written`` entry is True: ``nki::<name>(Tensor t0, Tensor(a1!) t1, ..., int form)
    -> Tensor[]`` (an overload of that name for each other count or written set)."""
    name = _op_name(name)
    key = (name, count, tuple(bool(w) for w in written))
    op = _OPS.get(key)
    if op is not None:
        return op
    with HOST_LOCK:
        op = _OPS.get(key)
        if op is None:
            op = _OPS[key] = _define(name, count, key[2])
    return op


def _define(name: str, count: int, written: tuple):
    library = _library()
    defined = _OVERLOADS.setdefault(name, 0)
    _OVERLOADS[name] = defined + 1
    overload = "default" if defined == 0 else f"form{defined}"
    arguments = ", ".join(f"Tensor(a{i}!) t{i}" if w else f"Tensor t{i}" for i, w in enumerate(written))
    qualified = name if overload == "default" else f"{name}.{overload}"
    library.define(f"{qualified}({arguments}, int form) -> Tensor[]")
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    op = getattr(packet, overload)

    def fake(*args):
        form = FORMS[args[-1]]
        device = args[0].device
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in form.infer(args[:-1])]

    def on_cpu(*args):  # the device worker: the storages' bytes as CPU tensors
        return FORMS[args[-1]].run(list(args[:-1]))

    torch.library.register_fake(f"{NAMESPACE}::{qualified}", fake, lib=library)
    library.impl(qualified, on_cpu, "CPU")
    library.impl(qualified, user_facing(_device_kernel(op)), "PrivateUse1")
    cost_model.KERNEL_TIMES[op] = lambda args, kwargs: FORMS[args[-1]].device_us(args[:-1])
    CUSTOM_KERNEL_OPS.add(op)
    return op


def _device_kernel(op):
    """The op at PrivateUse1: the per-op path under the host lock, as every device op."""
    entry = op_entry(op)
    run_entry = on_its_device(run) if MULTI else run
    acquire, release = HOST_LOCK.acquire, HOST_LOCK.release

    def kernel(*args, **kwargs):
        acquire()
        try:
            return run_entry(entry, args, kwargs)
        finally:
            release()

    return kernel
