"""Built kernels: a hot fused kernel's ops made into one function that runs in C++.

Entry points: :func:`build` (a fused kernel's records and spec -> :class:`BuiltKernel`,
or None) and :func:`same_outputs` (the check every build passes before it is used). The
fused kernel (``device/hardware/fused_kernel.py``) decides when to build, and keeps what it built.

A fused kernel first runs op by op from Python on the device worker. Each ATen call
releases the GIL and takes it back afterwards, and while the host thread is busy issuing
the next ops, taking it back waits: on a training step that wait is as large as all of
the worker's own Python work. When a kernel launches a second time (it is hot: the loop
came round again), it is *built*: its ops are written out as one TorchScript function,
compiled once, and kept in the fused kernels' state table (``fused_kernel.STATE``, by
its ``KernelSpec``). One call then runs all
its ops without coming back to Python; dead intermediates stay local to the function. A
matched chain inside it (the planner's pattern library) is one call of its library kernel,
whose implementation TorchScript compiles too.

A build is trusted only after its first run gives bit-identical outputs to the op-by-op
run of the same launch; otherwise the kernel stays op by op, and the reason goes to the
``adaptive_eager.fusion`` logger at DEBUG. Not built, and run op by op every time:

- kernels that update a tensor in place (``add_``, the optimizers' ``_foreach_*_``): a
  built run that fails half-way could not be replayed op by op to name the failing op,
  since the updates before it already happened. Writes that replay safely are built: to
  a value produced inside the kernel, or to a whole tensor the kernel has not touched
  before, by an op that overwrites it without reading it (``fill_``, ``zero_``,
  ``copy_``, ``out=``);
- random ops (their generator is the device's, advanced op by op);
- float constants inside lists, and arguments TorchScript has no literal for.

``NEURON_ADAPTIVE_COMPILE=0`` turns building off (kernels then always run op by op).
"""
from __future__ import annotations

import inspect
import logging
import textwrap
import typing

import torch

from ..core.config import CONFIG
from ..memory.storage import DeviceStorage, ViewRef
from .op_record import resolve

LOG = logging.getLogger("adaptive_eager.fusion")
HOT_AFTER = 2  # a kernel is built at its second launch


class NotBuildable(Exception):
    """Why a fused kernel stays op by op."""


class BuiltKernel:
    """A fused kernel's ops as one built function (TorchScript).

    ``sources`` says where each of the function's inputs comes from in a launch's records
    (``(member offset, keyword or None, argument index, list index or None)``, plus
    ``"offset"`` for a view's storage offset), and
    ``outputs`` which results its returned tensors are (``(member offset, position)``)."""

    __slots__ = ("function", "sources", "outputs", "source")

    def __init__(self, function, sources, outputs, source) -> None:
        self.function = function
        self.sources = sources
        self.outputs = outputs
        self.source = source  # the TorchScript text, for debugging

    def run(self, records) -> tuple:
        arguments = []
        append = arguments.append
        for source in self.sources:
            record = records[source[0]]
            keyword = source[1]
            value = record.args[source[2]] if keyword is None else record.kwargs[keyword]
            if source[3] is not None:
                value = value[source[3]]
            if len(source) == 5:  # the offset of a view of a value made inside the kernel
                append(value.offset)
                continue
            kind = type(value)
            if kind is DeviceStorage:
                data = value.data
                append(data if data is not None else value.materialize())
            elif kind is ViewRef:
                append(value.resolve(resolve(value.storage)))
            else:
                append(value)
        return self.function(*arguments)


_LITERAL_KINDS = (torch.dtype, torch.layout, torch.memory_format)
_OVERWRITING = {torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default,
                torch.ops.aten.copy_.default}


def _overwritten(record) -> set:
    """The storages this op overwrites whole, without reading what they held."""
    targets = []
    if record.op in _OVERWRITING:
        targets.append(record.args[0])
    for argument in record.op._schema.arguments:
        if argument.is_out and argument.name in record.kwargs:
            targets.append(record.kwargs[argument.name])
    return {
        target for target in targets
        if type(target) is DeviceStorage and sum(storage is target for storage in record.reads) <= 1
    }


class _Writer:
    """Writes one fused kernel's records as the body of a TorchScript function."""

    def __init__(self, records) -> None:
        self.records = records
        self.names: dict = {}  # storage produced inside the kernel -> its variable
        self.touched: set = set()  # storages earlier ops read or wrote
        self.overwritten: set = set()  # outside storages overwritten whole here (replay-safe)
        self.parameters: list = []
        self.sources: list = []
        self.lines: list = []
        self.libraries: dict = {}  # name in the source -> scripted library kernel

    def _input(self, annotation: str, source) -> str:
        name = f"a{len(self.parameters)}"
        self.parameters.append(f"{name}: {annotation}")
        self.sources.append(source)
        return name

    def expression(self, value, source, in_list: bool = False) -> str:
        kind = type(value)
        if kind is DeviceStorage:
            name = self.names.get(value)
            return name if name is not None else self._input("Tensor", source)
        if kind is ViewRef:
            base = self.names.get(value.storage)
            if base is None:
                return self._input("Tensor", source)
            # A view of a value produced here: the op-by-op run keeps such values in their
            # storage's layout, and the same inputs give the same layout here (the check
            # of the first run would catch a difference). Shape and strides are part of
            # the op's signature; the offset is not (x[i] for any i): an input.
            offset = self._input("int", source + ("offset",))
            return f"torch.ops.aten.as_strided({base}, {list(value.shape)}, {list(value.stride)}, {offset})"
        if kind is bool or kind is int:
            return repr(value)
        if kind is float:
            if in_list:
                raise NotBuildable("a float constant inside a list")
            return self._input("float", source)
        if value is None:
            return "None"
        if kind is str:
            return repr(value)
        if kind in _LITERAL_KINDS:
            return repr(value)  # torch.float32, torch.strided, torch.contiguous_format
        if kind is torch.device:
            return f'torch.device("{value}")'
        if isinstance(value, torch.Tensor):  # a host scalar tensor, cloned at record time
            return self._input("Tensor", source)
        if kind is list or kind is tuple:
            offset, keyword, index, _ = source
            items = [self.expression(item, (offset, keyword, index, at), True) for at, item in enumerate(value)]
            return "[" + ", ".join(items) + "]"
        raise NotBuildable(f"an argument of type {kind.__name__}")

    def resolve(self, name: str):
        """Names the kernel's source uses: ``torch``, and its library kernels."""
        return torch if name == "torch" else self.libraries.get(name)

    def library(self, pattern) -> None:
        """A matched chain: one call of its library kernel (scripted), at its last op."""
        function = _scripted(pattern.impl)
        name = f"library_{pattern.root}"
        self.libraries[name] = function
        call = [self.expression(self.records[offset].args[index], (offset, None, index, None))
                for offset, index in pattern.inputs]
        for keyword, value in pattern.constants.items():
            if type(value) is float:
                call.append(f"{keyword}={value!r}")  # checked once per launch at hand-over (plan.library_kernels_off)
            else:
                call.append(f"{keyword}={self.expression(value, None)}")
        self.lines.append(f"l{pattern.root} = {name}({', '.join(call)})")
        for at, (offset, position) in enumerate(pattern.outputs):
            variable = f"v{offset}_{position}"
            self.lines.append(f"{variable} = l{pattern.root}[{at}]")
            self.names[self.records[offset].results[position]] = variable
        for offset in pattern.members:
            self.touched.update(self.records[offset].reads)

    def op(self, offset: int, record) -> None:
        for storage in record.writes:
            if storage in self.names or storage in self.overwritten:
                continue
            if storage in self.touched or storage not in _overwritten(record):
                raise NotBuildable(f"{record.name} updates a tensor in place")
            self.overwritten.add(storage)
        self.touched.update(record.reads)
        self.touched.update(record.writes)
        schema = record.op._schema
        namespace, _, name = schema.name.partition("::")
        call = [self.expression(value, (offset, None, index, None)) for index, value in enumerate(record.args)]
        for keyword, value in record.kwargs.items():
            if isinstance(value, torch.Generator):
                raise NotBuildable(f"{record.name} draws random numbers")
            call.append(f"{keyword}={self.expression(value, (offset, keyword, 0, None))}")
        text = f"torch.ops.{namespace}.{name}({', '.join(call)})"
        returns = schema.returns
        kinds = [ret.type.kind() for ret in returns]
        variables = [f"v{offset}_{position}" for position in range(len(record.results))]
        if kinds == ["TensorType"]:
            self.lines.append(f"{variables[0]} = {text}")
        elif kinds and all(kind == "TensorType" for kind in kinds) and len(kinds) == len(variables):
            self.lines.append(f"{', '.join(variables)} = {text}")
        elif kinds == ["ListType"] and returns[0].type.getElementType().kind() == "TensorType":
            self.lines.append(f"l{offset} = {text}")
            self.lines.extend(f"{variable} = l{offset}[{position}]" for position, variable in enumerate(variables))
        else:
            raise NotBuildable(f"{record.name} returns {schema.returns}")
        for position, storage in enumerate(record.results):
            if storage is not None:
                self.names[storage] = variables[position]


_SCRIPTED: dict = {}


def _scripted(function):
    """A library kernel's implementation, compiled by TorchScript once (from its source,
    as a kernel is: ``torch.jit.script`` would warn that it is deprecated)."""
    scripted = _SCRIPTED.get(function)
    if scripted is None:
        names = {"torch": torch, "List": typing.List, "Optional": typing.Optional}

        def resolve(name):  # torch, typing, and the functions it calls (scripted too)
            found = names.get(name)
            if found is None and inspect.isfunction(function.__globals__.get(name)):
                found = _scripted(function.__globals__[name])
            return found

        unit = torch.jit.CompilationUnit()
        unit.define(textwrap.dedent(inspect.getsource(function)), rcb=resolve)
        scripted = _SCRIPTED[function] = getattr(unit, function.__name__)
    return scripted


def build(records, spec) -> BuiltKernel | None:
    """Compile a fused kernel's ops (see the module docstring); None when it cannot be."""
    writer = _Writer(records)
    at_root = {pattern.root: pattern for pattern in spec.patterns}
    skipped = {offset for pattern in spec.patterns for offset in pattern.members[:-1]}
    try:
        for offset, record in enumerate(records):
            if offset in at_root:
                writer.library(at_root[offset])
            elif offset not in skipped:
                writer.op(offset, record)
    except NotBuildable as reason:
        LOG.debug("kernel %s stays op by op: %s", spec.name, reason)
        return None
    outputs = tuple(
        (offset, position)
        for offset, record in enumerate(records)
        for position, storage in enumerate(record.results)
        if storage is not None and (offset, position) not in spec.dead
    )
    returned = ", ".join(f"v{offset}_{position}" for offset, position in outputs)
    source = "\n".join(
        [f"def kernel({', '.join(writer.parameters)}):"]
        + [f"    {line}" for line in writer.lines]
        + [f"    return ({returned}{',' if len(outputs) == 1 else ''})", ""]
    )
    # Run the ops exactly as written: TorchScript's graph optimizations would rewrite them
    # (addmm into mm and add, for one), and results would differ in the last bit. The
    # setting is per thread: the device worker, which builds and runs every kernel.
    torch._C._set_graph_executor_optimize(False)
    try:
        unit = torch.jit.CompilationUnit()
        unit.define(source, rcb=writer.resolve)
        function = unit.kernel
    except Exception as error:  # noqa: BLE001 - TorchScript refuses: stay op by op
        LOG.debug("kernel %s stays op by op: TorchScript: %s", spec.name, str(error).strip().splitlines()[0])
        return None
    return BuiltKernel(function, tuple(writer.sources), outputs, source)


def same_outputs(built_outputs, records, outputs) -> bool:
    """Are a built run's outputs bit-identical to what the op-by-op run stored?"""
    if len(built_outputs) != len(outputs):
        return False
    for value, (offset, position) in zip(built_outputs, outputs):
        expected = records[offset].results[position].data
        if expected is None or value.shape != expected.shape or value.dtype != expected.dtype:
            return False
        if value.is_floating_point() or value.is_complex():
            if not torch.equal(torch.isnan(value), torch.isnan(expected)):
                return False
            value, expected = torch.nan_to_num(value), torch.nan_to_num(expected)
        if not torch.equal(value, expected):
            return False
    return True
