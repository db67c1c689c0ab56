"""Running kernels: ``@nki.jit``, ``nki.simulate`` and ``nki.run``.

``nki.simulate(kernel)(*arrays)`` follows ``nki/guides/nki_simulator.rst``: every numpy array
argument becomes an HBM tensor over the array's own memory (``nl.hbm``; ``nl.shared_hbm`` for a
``kernel[2]`` launch), other arguments pass through, the kernel runs eagerly as Python, returned
tensors come back as numpy arrays, and input arrays the kernel wrote are updated in place. A
``kernel[n]`` launch runs its ``n`` programs in ``n`` threads (``program_id`` 0..n-1) sharing HBM;
``nl.shared_hbm`` tensors a kernel allocates are shared between the programs (the k-th such
allocation of every program is one tensor). torch CPU tensors work too and come back as torch
tensors.

``nki.run(kernel, *args)`` is the same run returning ``(outputs, trace, time_us)`` - the
instruction trace and the simulated device time (``nki.cost.schedule`` plus one launch).

Calling a kernel with ``neuron`` torch tensors is one kernel launch on the device's queue
(``_torch.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _dtypes
from . import cost as _cost
from ._launch import kernel_key, launch
from ._state import NkiValidationError, trim_traceback
from .tensor import NkiTensor, from_numpy, private_hbm, shared_hbm


class Kernel:
    """An ``@nki.jit`` kernel. ``kernel[n]`` launches it on an SPMD grid of ``n`` programs (LNC=n)."""

    def __init__(self, fn, grid=(), options=None):
        self.fn = fn
        self.grid = grid
        self.options = dict(options or {})
        functools.update_wrapper(self, fn)
        # a number for the kernel and its grid: what a device call passes to ``_torch.device_call``
        # (an int, so that torch.compile puts the call in its graph as one node)
        self.key = kernel_key(self)

    def __getitem__(self, grid):
        grid = tuple(int(g) for g in grid) if isinstance(grid, (tuple, list)) else (int(grid),)
        if any(g < 1 for g in grid):
            raise ValueError(f"launch grid {grid}: every size must be >= 1")
        return Kernel(self.fn, grid, self.options)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "kernel")

    def __call__(self, *args, **kwargs):
        from ._state import maybe_current

        if _on_device(args) or _on_device(kwargs.values()):
            from . import _torch  # imports torch and the device: only for neuron tensors

            return _torch.device_call(self.key, *args, **kwargs)
        if maybe_current() is not None:  # a kernel calling another: inlined, as the compiler does
            return self.fn(*args, **kwargs)
        return simulate(self)(*args, **kwargs)

    def __repr__(self):
        grid = f"[{', '.join(map(str, self.grid))}]" if self.grid else ""
        return f"<nki kernel {self.name}{grid}>"


def jit(fn=None, **kwargs):
    """``@nki.jit`` / ``@nki.jit(...)``: wrap a kernel function. Options are accepted and kept
    (the simulator compiles nothing)."""
    if fn is None:
        return lambda f: Kernel(f, (), kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, (), kwargs)


def _as_kernel(kernel) -> Kernel:
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


@dataclasses.dataclass
class RunResult:
    """What :func:`run` returns; unpacks as ``outputs, trace, time_us``."""

    outputs: object
    trace: list
    schedule: _cost.Schedule
    sbuf_peak_bytes: int = 0
    psum_peak_bytes: int = 0

    @property
    def time_us(self) -> float:
        return self.schedule.total_us

    def __iter__(self):
        return iter((self.outputs, self.trace, self.time_us))

    def report(self, limit: int = 20) -> str:
        s = self.schedule
        lines = [f"simulated time {s.total_us:.2f} us (device {s.device_ns / 1000:.2f} us + launch "
                 f"{s.launch_ns / 1000:.2f} us), {len(self.trace)} instructions; "
                 f"peak SBUF {self.sbuf_peak_bytes} B/partition, PSUM {self.psum_peak_bytes} B/partition"]
        for engine, busy in s.busy_ns.items():
            if s.count[engine]:
                lines.append(f"  {engine:<8} {s.count[engine]:>6} instructions, busy {busy / 1000:.2f} us")
        for ins in self.trace[:limit]:
            lines.append("  " + ins.summary())
        if len(self.trace) > limit:
            lines.append(f"  ... {len(self.trace) - limit} more")
        return "\n".join(lines)


# -- argument conversion ---------------------------------------------------------------------------------


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _on_device(values) -> bool:
    """Does any argument (nested in lists, tuples, dicts) hold a torch tensor on a device (a
    ``neuron`` tensor), or a FakeTensor (tracing: ``torch.compile``, a custom op's fake kernel)?
    Then the call is one kernel op (``_torch.py``)."""
    for value in values:
        if _is_torch(value):
            if value.device.type != "cpu" or type(value).__name__ == "FakeTensor":
                return True
        elif isinstance(value, (list, tuple)):
            if _on_device(value):
                return True
        elif isinstance(value, dict):
            if _on_device(value.values()):
                return True
    return False


def _torch_to_numpy(t):
    import torch

    if t.device.type != "cpu":
        raise TypeError(f"nki.simulate: a {t.device.type} tensor; the simulator takes numpy arrays or CPU torch "
                        "tensors (call the @nki.jit kernel itself on neuron tensors: one kernel on the device)")
    t = t.detach().contiguous()
    special = {torch.bfloat16: (torch.int16, _dtypes.bfloat16)}
    for name, nki_dtype in (("float8_e4m3fn", _dtypes.float8_e4m3fn), ("float8_e5m2", _dtypes.float8_e5m2)):
        if hasattr(torch, name):
            special[getattr(torch, name)] = (torch.uint8, nki_dtype)
    if t.dtype in special:
        view, dtype = special[t.dtype]
        return t.view(view).numpy().view(dtype)
    return t.numpy()


def _numpy_to_torch(a):
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == _dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == _dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if a.dtype == _dtypes.float8_e5m2:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e5m2)
    return torch.from_numpy(a.copy())


class _Inputs:
    """Kernel arguments as HBM tensors over the callers' arrays, and the write-back afterwards."""

    def __init__(self, args, kwargs, buffer):
        self.buffer = buffer
        self.writebacks = []  # (original, working array)
        self.torch = False
        self.args = [self.convert(a, f"arg{i}") for i, a in enumerate(args)]
        self.kwargs = {k: self.convert(v, k) for k, v in kwargs.items()}

    def convert(self, value, name):
        if _is_torch(value):
            self.torch = True
            array = _torch_to_numpy(value)
            tensor = self.convert(np.array(array, copy=True), name)
            self.writebacks.append((value, tensor))
            return tensor
        if isinstance(value, np.ndarray):
            if value.flags.c_contiguous and value.flags.writeable:
                return from_numpy(value, self.buffer, name)
            working = np.ascontiguousarray(value).copy()
            tensor = from_numpy(working, self.buffer, name)
            if value.flags.writeable:
                self.writebacks.append((value, tensor))
            return tensor
        if isinstance(value, (list, tuple)) and value and any(isinstance(v, np.ndarray) or _is_torch(v) for v in value):
            return type(value)(self.convert(v, f"{name}[{i}]") for i, v in enumerate(value))
        if isinstance(value, (np.generic,)) and not isinstance(value, np.ndarray):
            return value.item()
        return value

    def write_back(self):
        for original, tensor in self.writebacks:
            values = tensor.numpy().reshape(tensor.shape)
            if _is_torch(original):
                original.copy_(_numpy_to_torch(values).reshape(original.shape))
            else:
                original[...] = values


def _outputs(value, as_torch):
    if isinstance(value, NkiTensor):
        array = value.numpy()
        return _numpy_to_torch(array) if as_torch else array
    if isinstance(value, (list, tuple)):
        return type(value)(_outputs(v, as_torch) for v in value)
    if isinstance(value, dict):
        return {k: _outputs(v, as_torch) for k, v in value.items()}
    return value


# -- execution ----------------------------------------------------------------------------------------------


def _execute(kernel: Kernel, args, kwargs):
    nprograms = math.prod(kernel.grid) if kernel.grid else 1
    inputs = _Inputs(args, kwargs, shared_hbm if nprograms > 1 else private_hbm)
    result, programs = launch(kernel, inputs.args, inputs.kwargs)
    inputs.write_back()
    outputs = _outputs(result, inputs.torch)
    trace = [ins for program in programs for ins in program.trace]
    return outputs, trace, programs


def simulate(kernel):
    """``nki.simulate(kernel)(*arrays)``: run ``kernel`` on the CPU simulator and return its outputs
    as numpy arrays (torch tensors for torch inputs); input arrays the kernel wrote are updated in place."""
    k = _as_kernel(kernel)

    @functools.wraps(k.fn)
    def simulated(*args, **kwargs):
        try:
            outputs, _, _ = _execute(k, args, kwargs)
        except NkiValidationError as error:
            raise trim_traceback(error)
        return outputs

    return simulated


def run(kernel, *args, launch: bool = True, **kwargs) -> RunResult:
    """Run ``kernel`` on numpy arrays; returns a :class:`RunResult` (``outputs, trace, time_us =``)."""
    k = _as_kernel(kernel)
    try:
        outputs, trace, programs = _execute(k, args, kwargs)
    except NkiValidationError as error:
        raise trim_traceback(error)
    schedule = _cost.schedule(trace, launch=launch)
    return RunResult(outputs, trace, schedule, max(p.sbuf.peak for p in programs),
                     max(p.psum.peak for p in programs))
