"""NKI kernels on ``neuron`` torch tensors: one kernel launch on the device's queue.

Calling an ``@nki.jit`` kernel with neuron tensors (``Kernel.__call__`` sends such calls here)
returns neuron tensors and is one op, ``torch.ops.nki.<kernel name>``, recorded as every device
op is (``adaptive_eager_device/ops/custom_kernels.py``): in strict eager one launch, in adaptive
eager one window entry the planner never fuses, in compiled mode one node of the graph.

- **The call's form.** The kernel, its launch grid and the call's non-tensor arguments (keyed
  by value: TorchNeuron compiles a kernel once per shapes, dtypes and non-tensor argument
  values) make a :class:`NkiForm`, numbered once; the tensors are the op's arguments.
- **The trial, once per form and input shapes/dtypes** (:meth:`NkiForm.trial`): the kernel
  runs on the simulator on zero-filled arrays of the inputs' shapes and dtypes, on the host,
  at the call. What the host can see raises there, at the kernel's line: the kernel's own
  checks of its arguments' shapes and dtypes, NKI validation (tiles past 128 partitions,
  operands in the wrong buffer, SBUF/PSUM overflow, mismatched shapes...), a dtype NKI lacks.
  It gives the outputs' shapes and dtypes (the op's meta and fake kernel: FakeTensor and
  ``torch.compile`` see them), which inputs the kernel writes (the op's schema marks them
  ``Tensor(a!)``), which returned tensors are inputs, and the kernel's schedule (its simulated
  device time: ``nki.cost.schedule`` of the trial's instructions; the queue adds the launch). The trial
  assumes what NKI's compiler assumes: control flow depends on shapes and non-tensor
  arguments, not on tensor values; a kernel whose loops follow data it reads into registers
  (``dynamic_range``) is timed by the trial's data (zeros).
- **On the device worker** (:meth:`NkiForm.run`), in issue order, the kernel runs on the
  simulator over the storages' bytes: numpy views of the CPU tensors that hold them
  (bfloat16 and float8 through ``ml_dtypes``; a non-contiguous view is copied in and, if
  written, back). Its errors (an index read from data out of bounds, ...) are the kernel's
  failure, deferred to the next sync point like any kernel's: the error names the op
  (``nki::<kernel>``), the user's line that called it, the instruction and the kernel's line.
"""
from __future__ import annotations

import numpy as np
import torch
from adaptive_eager_device.ops import custom_kernels

from . import _dtypes
from . import cost as _cost
from ._launch import KERNELS, launch
from .tensor import NkiTensor, from_numpy, private_hbm, shared_hbm

_TORCH_TO_NKI = {
    torch.float32: _dtypes.float32, torch.float16: _dtypes.float16, torch.bfloat16: _dtypes.bfloat16,
    torch.int8: _dtypes.int8, torch.int16: _dtypes.int16, torch.int32: _dtypes.int32, torch.uint8: _dtypes.uint8,
    torch.bool: _dtypes.bool_, torch.uint16: _dtypes.uint16, torch.uint32: _dtypes.uint32,
    torch.float8_e4m3fn: _dtypes.float8_e4m3fn, torch.float8_e5m2: _dtypes.float8_e5m2,
}
_NKI_TO_TORCH = {v: k for k, v in _TORCH_TO_NKI.items()}
# dtypes numpy cannot hold as torch does: viewed through an integer of their width
_VIEWED = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
_VIEWED_BACK = {_dtypes.bfloat16: (np.int16, torch.bfloat16), _dtypes.float8_e4m3fn: (np.uint8, torch.float8_e4m3fn),
                _dtypes.float8_e5m2: (np.uint8, torch.float8_e5m2)}

_FORMS: dict = {}  # (fn, grid, structure) -> NkiForm


# -- arguments ----------------------------------------------------------------------------------------------


def _flatten(value, tensors: list, values: list):
    """The call's structure, hashable: tensors -> ("t", i) (appended to ``tensors``), other
    leaves -> ("v", key) (the value appended to ``values``; ``key`` its value, or its identity
    when it is not hashable)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("t", len(tensors) - 1)
    kind = type(value)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(_flatten(v, tensors, values) for v in value))
    if kind is dict:
        return ("dict", tuple((k, _flatten(v, tensors, values)) for k, v in value.items()))
    values.append(value)
    try:
        hash(value)
        key = (kind, value)
    except TypeError:
        key = (kind, "id", id(value))
    return ("v", key)


def _rebuild(structure, tensors, values, position=None):
    """The call's arguments back, tensors from ``tensors`` (NKI tensors), values in order."""
    position = position if position is not None else [0]
    kind = structure[0]
    if kind == "t":
        return tensors[structure[1]]
    if kind == "v":
        value = values[position[0]]
        position[0] += 1
        return value
    if kind == "dict":
        return {k: _rebuild(v, tensors, values, position) for k, v in structure[1]}
    items = [_rebuild(v, tensors, values, position) for v in structure[1]]
    return items if kind == "list" else tuple(items)


def _nki_dtype(tensor, kernel_name):
    dtype = _TORCH_TO_NKI.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"NKI kernel {kernel_name}: an argument is {tensor.dtype}, which NKI has no type for "
                        f"(NKI: float32, bfloat16, float16, float8, int8/16/32, uint8/16/32, bool); convert it first")
    return dtype


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """The CPU tensor's bytes as a numpy array (no copy: a strided view when ``t`` is one)."""
    t = t.detach()
    viewed = _VIEWED.get(t.dtype)
    if viewed is not None:
        return t.view(viewed).numpy().view(_TORCH_TO_NKI[t.dtype])
    return t.numpy()


def _to_torch(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    back = _VIEWED_BACK.get(array.dtype)
    if back is not None:
        return torch.from_numpy(array.view(back[0])).view(back[1])
    return torch.from_numpy(array)


# -- the kernel's form and its trials -----------------------------------------------------------------------


class Trial:
    """What a kernel does for one set of input shapes and dtypes (its run on zeros)."""

    __slots__ = ("outputs", "written", "result", "device_us", "instructions")

    def __init__(self, outputs, written, result, device_us, instructions):
        self.outputs = outputs  # [(shape, torch dtype)] of the fresh outputs
        self.written = written  # per input tensor: does the kernel write it?
        self.result = result  # the returned structure: ("out", k), ("in", i), ("none",), lists, tuples
        self.device_us = device_us  # the schedule, without the launch
        self.instructions = instructions


class NkiForm(custom_kernels.KernelForm):
    """One NKI kernel called one way: its function, launch grid and non-tensor arguments."""

    def __init__(self, kernel, structure, values):
        self.kernel = kernel
        self.name = kernel.name
        self.structure = structure
        self.values = values
        self.nprograms = int(np.prod(kernel.grid)) if kernel.grid else 1
        self.trials: dict = {}
        custom_kernels.register_form(self)

    # host side ----------------------------------------------------------------------------------------
    def specs(self, tensors) -> tuple:
        return tuple((tuple(int(n) for n in t.shape), _nki_dtype(t, self.name)) for t in tensors)

    def trial(self, specs) -> Trial:
        found = self.trials.get(specs)
        if found is None:
            found = self.trials[specs] = self._trial(specs)
        return found

    def _buffer(self):
        return shared_hbm if self.nprograms > 1 else private_hbm

    def _trial(self, specs) -> Trial:
        arrays = [np.zeros(shape, dtype=dtype) for shape, dtype in specs]
        inputs = [from_numpy(a, self._buffer(), f"arg{i}") for i, a in enumerate(arrays)]
        args, kwargs = _rebuild(self.structure, inputs, self.values)
        result, programs = launch(self.kernel, args, kwargs)
        trace = [ins for program in programs for ins in program.trace]
        by_storage = {id(t.storage): i for i, t in enumerate(inputs)}
        written_ids = {rect[0] for ins in trace for rect in ins.writes}
        written = tuple(id(t.storage) in written_ids for t in inputs)
        outputs = []

        def describe(value):
            if isinstance(value, NkiTensor):
                index = by_storage.get(id(value.storage))
                if index is not None and value.shape == inputs[index].shape and value.offset == 0:
                    return ("in", index)
                dtype = _NKI_TO_TORCH.get(value.dtype)
                if dtype is None:
                    raise TypeError(f"NKI kernel {self.name} returns a {_dtypes.name(value.dtype)} tensor, which torch "
                                    "has no dtype for")
                outputs.append((tuple(value.shape), dtype))
                return ("out", len(outputs) - 1)
            if value is None:
                return ("none",)
            if isinstance(value, (list, tuple)):
                return (type(value).__name__, tuple(describe(v) for v in value))
            raise TypeError(f"NKI kernel {self.name} returns a {type(value).__name__}; called on neuron tensors, a "
                            "kernel returns tensors (or tuples and lists of them, or None)")

        structure = describe(result)
        device_us = _cost.schedule(trace, launch=False).device_ns / 1000.0
        return Trial(outputs, written, structure, device_us, len(trace))

    def infer(self, tensors) -> list:
        return self.trial(self.specs(tensors)).outputs

    def device_us(self, tensors) -> float:
        return self.trial(self.specs(tensors)).device_us

    # the device worker --------------------------------------------------------------------------------
    def run(self, tensors) -> list:
        written = self.trial(self.specs(tensors)).written
        copies = []  # (original, contiguous working copy): written non-contiguous views
        inputs = []
        for i, t in enumerate(tensors):
            array = _numpy_view(t)
            if not (array.flags.c_contiguous and array.flags.writeable):
                working = np.ascontiguousarray(array).copy()
                if written[i]:
                    copies.append((array, working))
                array = working
            inputs.append(from_numpy(array, self._buffer(), f"arg{i}"))
        args, kwargs = _rebuild(self.structure, inputs, self.values)
        result, _ = launch(self.kernel, args, kwargs)
        for original, working in copies:
            original[...] = working
        inputs_by_storage = {id(t.storage) for t in inputs}
        outputs = []

        def collect(value):
            if isinstance(value, NkiTensor):
                if id(value.storage) not in inputs_by_storage:
                    outputs.append(_to_torch(value.read("output")))
            elif isinstance(value, (list, tuple)):
                for v in value:
                    collect(v)

        collect(result)
        return outputs


def _form(kernel, structure, values) -> NkiForm:
    key = (kernel.fn, kernel.grid, structure)
    form = _FORMS.get(key)
    if form is None:
        form = _FORMS[key] = NkiForm(kernel, structure, values)
    return form


# -- the call -----------------------------------------------------------------------------------------------


def device_call(key, *args, **kwargs):
    """``Kernel.__call__`` with neuron tensors: the kernel numbered ``key`` (``_launch.KERNELS``).
    ``torch.compile`` puts a call of this function in its graph as one node (``allow_in_graph``,
    below), traced by AOTAutograd on FakeTensors down to the kernel's op."""
    return call(KERNELS[key], args, kwargs)


def call(kernel, args, kwargs):
    """``kernel(*args, **kwargs)`` with neuron tensors: one op on the device (module docstring)."""
    tensors: list = []
    values: list = []
    structure = _flatten((tuple(args), dict(kwargs)), tensors, values)
    fake = all(type(t).__name__ == "FakeTensor" for t in tensors)  # tracing: shapes only, on any device
    for t in tensors:
        if t.device.type != "neuron" and not fake:
            raise RuntimeError(f"NKI kernel {kernel.name}: every tensor argument must be on the neuron device; "
                               f"got one on {t.device}")
    form = _form(kernel, structure, values)
    trial = form.trial(form.specs(tensors))
    written = [t for t, w in zip(tensors, trial.written) if w]
    if written and torch.is_grad_enabled():
        for t in written:
            if t.requires_grad and t.is_leaf:
                raise RuntimeError(f"NKI kernel {kernel.name} writes an argument that is a leaf Variable that "
                                   "requires grad (an in-place operation on it)")
    op = custom_kernels.kernel_op(kernel.name, len(tensors), trial.written)
    outputs = op(*tensors, form.number)
    for t in written:
        torch.autograd.graph.increment_version(t)
    return _result(trial.result, outputs, tensors)


def _result(structure, outputs, tensors):
    kind = structure[0]
    if kind == "out":
        return outputs[structure[1]]
    if kind == "in":
        return tensors[structure[1]]
    if kind == "none":
        return None
    items = [_result(s, outputs, tensors) for s in structure[1]]
    return items if kind == "list" else tuple(items)


torch._dynamo.allow_in_graph(device_call)
