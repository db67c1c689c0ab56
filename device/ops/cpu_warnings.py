"""The CPU's warnings for an op's arguments, which the device gives the user at each call.

A kernel runs on the device's worker thread, whose warnings reach no one; the warnings
the CPU kernel gives at the call come from a CPU run on the host when the signature is
new (``shapes.check_on_cpu``'s one-element trial, or :func:`cpu_warnings` for the
overrides that know the CPU's own), are kept with the signature
(``shapes.Inference.warnings``) and are given at the user's line at each call
(``recorder._forward_warnings``). C++ warnings are kept by ``_C.call_recording``.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import _C as _native

# How ATen's resize_output's warning starts (Resize.cpp), for an out= tensor with elements
RESIZED_WARNING = "An output with one or more elements was resized"


class CpuWarned:
    """A meta override's result with the warnings the CPU kernel gives for the call, in
    place of ATen's resize warning for an ``out=`` tensor (the CPU kernel resizes it
    quietly); the recorder gives them at each call."""

    __slots__ = ("result", "warnings")

    def __init__(self, result, given) -> None:
        self.result = result
        self.warnings = given


def cpu_warnings(op, meta_args, meta_kwargs) -> tuple:
    """The warnings the CPU kernel gives for these arguments (zero-filled tensors of
    their shapes: for ops whose warnings depend on shapes and scalars only)."""

    def cpu(value):
        if isinstance(value, torch.Tensor):
            return torch.zeros(value.shape, dtype=value.dtype)
        return torch.device("cpu") if isinstance(value, torch.device) else value

    return warnings_of_call(op, *[cpu(v) for v in meta_args], **{k: cpu(v) for k, v in meta_kwargs.items()})


def warnings_of_call(op, *args, **kwargs) -> tuple:
    """Call ``op`` on the CPU and return its warnings, Python's and C++'s, as
    :func:`kept_warnings` keeps them; its errors propagate."""
    with _disable_current_modes(), warnings.catch_warnings(record=True) as python_warnings:
        warnings.simplefilter("always")
        _, cpp_warnings = _native.call_recording(op, *args, **kwargs)
    return kept_warnings(python_warnings, cpp_warnings)


def kept_warnings(python_warnings, cpp_warnings) -> tuple:
    """((message, category), ...) of a CPU call's warnings, but ATen's resize warning for
    an out= tensor, which the recorder gives itself (``recorder._resize_outputs``)."""
    kept = [(str(w.message), w.category) for w in python_warnings]
    kept += [(message, DeprecationWarning if deprecation else UserWarning) for message, deprecation in cpp_warnings]
    return tuple((message, category) for message, category in kept if not message.startswith(RESIZED_WARNING))
