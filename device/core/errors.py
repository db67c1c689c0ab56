"""Deferred device errors: the first kernel failure, kept until the next sync point.

Entry points: :class:`NeuronRuntimeError` (what users catch), :class:`KernelFailure`
(one recorded failure with its context) and :class:`FailureState` (the queue's record of
the earliest failure not yet raised).

The contract (docs/ARCHITECTURE.md, "Errors"): a failing kernel is recorded, not raised.
Only the earliest failure is kept; later ones are counted. The next sync point raises it
as :class:`NeuronRuntimeError` and clears it. Outputs of the failed kernel, and of every
kernel that read a poisoned buffer afterwards, are poisoned: reading one raises an error
naming the original failure.
"""
from __future__ import annotations

import threading
import traceback

import torch

from .. import _C as _native
from .config import CONFIG
from .location import source_location

LAUNCH_BLOCKING_HINT = (
    "Errors on the neuron device are reported at the next synchronization point, so the "
    "Python traceback may point past the faulty op. Set NEURON_LAUNCH_BLOCKING=1 to raise "
    "at the faulty op."
)

_DTYPE_ABBREVIATIONS = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}


def describe_value(value) -> str:
    """``f32[2, 4]`` for tensors, lists of those, ``repr`` for the rest."""
    if isinstance(value, torch.Tensor):
        dtype = _DTYPE_ABBREVIATIONS.get(value.dtype, str(value.dtype).replace("torch.", ""))
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    return type(value).__name__


def describe_call(op_name: str, args, kwargs) -> str:
    parts = [describe_value(a) for a in args]
    parts += [f"{k}={describe_value(v)}" for k, v in (kwargs or {}).items()]
    return f"{op_name}({', '.join(parts)})"


QUANTIZED_DTYPES = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def quantized_refusal(op_name: str) -> NotImplementedError:
    """The device's refusal of a quantized tensor (no kernels for them; PyTorch's
    quantized kernels are the CPU's and CUDA's)."""
    return NotImplementedError(
        f"quantized tensors are not supported on the neuron device ({op_name}); quantize on the CPU, or "
        "keep the tensor in a floating-point dtype on the device"
    )


def users_error(error: BaseException) -> BaseException:
    """Mark ``error`` as the user's: the CPU's own error for the user's arguments (a shape
    or dtype error the CPU kernel raised), or the device refusing them on purpose (device
    mismatch, out of memory, sparse layouts). It then reads as the CPU's errors read: the
    kernel boundary (:func:`user_facing`) drops the device's
    frames, so the traceback ends at the user's line, and the chain (the meta kernel's
    rejection) is not shown. ``NEURON_FULL_STACK=1`` keeps both. Errors not marked (the
    device's own bugs) always keep their whole traceback. Returns ``error``."""
    if not CONFIG.full_stack:
        error.__neuron_user_error__ = True
        error.__cause__ = None
        error.__suppress_context__ = True
    return error


def user_facing(kernel):
    """``kernel`` as registered with the dispatcher: a C function around it
    (``_C.user_facing``) through which the user's errors (:func:`users_error`: the CPU's
    shape and dtype errors, the device's refusals) leave without a traceback, so Python
    shows them raised from the user's line alone, as on the CPU. Every kernel the device
    registers is wrapped so: the one place every op's error passes through on its way to
    the user."""
    return _native.user_facing(kernel)


class KernelFailure:
    """One kernel that failed on the queue, with the context captured at issue time."""

    __slots__ = ("op_name", "call", "location", "kernel_name", "original", "sequence", "issue")

    def __init__(self, op_name, call, location, kernel_name, original, sequence, issue) -> None:
        self.op_name = op_name  # "aten::embedding"
        self.call = call  # "aten::embedding(f32[10, 4], i64[2, 3])"
        self.location = source_location(location)  # SourceLocation of the user's line
        self.kernel_name = kernel_name  # fused kernel name, or None for a single op
        self.original = original  # the exception the kernel raised
        self.sequence = sequence  # launch number on the queue
        self.issue = issue  # the failing op's place in issue order (OpRecord.issue)

    def summary(self) -> str:
        inside = f" inside fused kernel '{self.kernel_name}'" if self.kernel_name else ""
        return f"{self.op_name}{inside}, issued at {self.location}"

    def message(self) -> str:
        original = f"{type(self.original).__name__}: {self.original}"
        lines = [
            f"neuron kernel failed: {self.op_name}"
            + (f" (inside fused kernel '{self.kernel_name}')" if self.kernel_name else ""),
            f"  issued at: {self.location}",
            f"  call: {self.call}",
            f"  error: {original}",
        ]
        stack = getattr(self.location, "stack", None)
        if stack:
            lines.append("  issued from (most recent call last):")
            lines += ["    " + line.rstrip() for line in _format_stack(stack)]
        if not CONFIG.launch_blocking:  # with it set, this is raised at the faulty op already
            lines.append(LAUNCH_BLOCKING_HINT)
        return "\n".join(lines)


def _format_stack(stack):
    return "".join(traceback.format_list(stack)).splitlines()


class NeuronRuntimeError(RuntimeError):
    """A device-side failure, raised at the sync point after it happened.

    ``failure`` holds the :class:`KernelFailure`; ``op_name`` and ``location`` name the
    faulty op and the user's line that issued it.
    """

    def __init__(self, message: str, failure: KernelFailure | None = None) -> None:
        super().__init__(message)
        self.failure = failure

    @property
    def op_name(self):
        return self.failure.op_name if self.failure else None

    @property
    def location(self):
        return self.failure.location if self.failure else None


class PoisonedTensorError(NeuronRuntimeError):
    """Reading a tensor whose producing kernel failed or was skipped after a failure."""


def poisoned_read_error(failure: KernelFailure) -> PoisonedTensorError:
    return PoisonedTensorError(
        "this neuron tensor holds no valid data: it was produced by a kernel that failed, "
        "or that was dropped because it was issued after a failure and before the sync "
        f"point that raised it. The original failure: "
        f"{failure.summary()}: {type(failure.original).__name__}: {failure.original}",
        failure,
    )


class FailureState:
    """The earliest kernel failure not yet raised, and a count of later ones.

    Earliest in issue order, not in the order the worker ran them: adaptive eager may
    run an op issued later first, and the error raised must be the one strict eager
    raises."""

    def __init__(self, pending=None) -> None:
        """``pending(bool)``: told when a failure starts and stops being pending (the device
        worker runs nothing natively meanwhile)."""
        self._lock = threading.Lock()
        self._pending = pending or (lambda _: None)
        self.first: KernelFailure | None = None
        self.later = 0

    def record(self, failure: KernelFailure) -> None:
        with self._lock:
            first = self.first
            if first is None:
                self.first = failure
                self._pending(True)
            else:
                if failure.issue < first.issue:
                    self.first = failure
                self.later += 1

    def take(self) -> KernelFailure | None:
        """Return and clear the earliest failure (None when there is none)."""
        with self._lock:
            failure, self.first = self.first, None
            self.later = 0
            if failure is not None:
                self._pending(False)
            return failure
