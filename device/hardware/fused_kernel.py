"""Fused kernels on the device worker: a planned window's launches, run as one command list.

Entry points: :class:`WindowLaunches` (a flushed window's launches, one queue item, or
one native launch: ``WindowLaunches.native``) and :class:`FusedKernel` (one launch that
runs several recorded ops, in Python).

The device executes a plan it is handed as data and never plans: the plan format is
``plan.py`` (``Plan``, ``KernelSpec``, ``PatternSpec``), which the planner
(``adaptive_eager.fusion``) builds; this module imports nothing of the planner, so
``adaptive_eager_device`` still imports alone. A window comes with the library kernels
its constants turn off for this launch (``plan.library_kernels_off``, checked once on the
host at hand-over): those chains run op by op.

A fused kernel runs its ops back to back on the device worker, in program order, keeping
its *dead intermediates* in an environment instead of device memory: an output produced
and consumed inside the kernel, with no live Python reference and no view at flush, is
never written back; a matched chain runs as one library kernel (a TorchScript function)
at its last op. A window runs as one native launch (``device/csrc/executor.cpp``: all of
it in C++, with no Python) unless an argument is one the native path does not resolve;
the Python path (:meth:`FusedKernel.execute`, each op through ``op_record.run_record``,
the per-op runner strict launches use too) runs what the native run hands back: a window
issued while a failure is pending, under fault injection or reading a poisoned input, or
the rest of a window from the op that raised.

When an op inside fails, the rest of the kernel runs op by op with strict eager's rules
(ops reading a poisoned buffer are skipped), the deferred error names the exact op and
the user's line, and the kernel's signature goes to the queue
(``ExecutionQueue.report_failed_kernel``), which hands it to the runtime at its next
flush (``take_failed_kernels``): the runtime marks the chain unfusable.
"""
from __future__ import annotations

import inspect
import logging
import math
import textwrap
import typing

import torch

from .. import _C as _native
from ..memory.storage import DeviceStorage, ViewRef
from .interleave import BROKEN, at_parameter, interleaved_runs
from .op_record import GUARDED_WRITES, in_layout, resolve, run_record

LOG = logging.getLogger("adaptive_eager.fusion")


_LIBRARY_FUNCTIONS: dict = {}


def library_function(impl):
    """A library kernel's implementation compiled by TorchScript, once (from its source:
    ``torch.jit.script`` would warn that it is deprecated), so that a native launch calls
    it from C++. The functions it calls are compiled with it."""
    compiled = _LIBRARY_FUNCTIONS.get(impl)
    if compiled is None:
        names = {"torch": torch, "List": typing.List, "Optional": typing.Optional}

        def resolve_name(name):  # torch, typing, and the functions it calls (compiled too)
            found = names.get(name)
            if found is None and inspect.isfunction(impl.__globals__.get(name)):
                found = library_function(impl.__globals__[name])
            return found

        unit = torch.jit.CompilationUnit()
        unit.define(textwrap.dedent(inspect.getsource(impl)), rcb=resolve_name)
        compiled = _LIBRARY_FUNCTIONS[impl] = getattr(unit, impl.__name__)
    return compiled


class WindowLaunches:
    """A flushed window's launches, in plan order, as one queue item: the host hands the
    device a command list (accounted kernel by kernel, ``ExecutionQueue.launch_batch``),
    and the device worker builds the fused kernels and runs them in order. ``launches`` is
    ``Plan.launches``: ``(position, None)`` for an op alone, ``(positions, KernelSpec)``."""

    __slots__ = ("launches", "records", "stream", "off", "programs")

    def __init__(self, launches, records, stream: int, off=frozenset(), programs=None) -> None:
        self.launches = launches
        self.records = records
        self.stream = stream
        self.off = off  # {(launch index, pattern index)}: library kernels off in this window
        self.programs = programs  # the plan's native programs (Plan.programs), or None

    def _fused(self, launch: int, members, spec) -> "FusedKernel":
        records = self.records
        off = self.off
        patterns_off = frozenset(index for index in range(len(spec.patterns)) if (launch, index) in off) if off else off
        return FusedKernel([records[index] for index in members], spec, self.stream, patterns_off)

    def kernels(self) -> list:
        """One queue item per launch (the trace and the profiler give each its own slot)."""
        records = self.records
        return [
            records[members] if spec is None else self._fused(launch, members, spec)
            for launch, (members, spec) in enumerate(self.launches)
        ]

    def execute(self, queue) -> None:
        self.resume(queue, 0, None)

    def resume(self, queue, resume: int, env) -> None:
        """Run the launches from ``resume`` (a launch index << 20 | an offset in it: where a
        native run of this window stopped, ``native``), with ``env``, the values the
        native run kept in registers. Each kernel's records are released once it has run,
        as strict eager drops each op: a buffer no later kernel reads is freed now, and its
        memory is reused by the next allocation instead of the window's footprint growing
        to its sum."""
        records = self.records
        first, offset = resume >> 20, resume & 0xFFFFF  # (offset may carry BROKEN: FusedKernel.resume)
        for launch, (members, spec) in enumerate(self.launches):
            if launch < first:
                continue
            if spec is None:
                kernel = records[members]
                records[members] = None
            else:
                kernel = self._fused(launch, members, spec)
                for index in members:
                    records[index] = None
            if launch == first and offset and spec is not None:
                kernel.resume(queue, offset, env)
            else:
                kernel.execute(queue)
            kernel = None

    def native(self):
        """The window as one native launch (``device/csrc/executor.cpp``: every kernel's ops
        in C++, the values a fused kernel keeps in registers in the run's environment, a
        matched chain as its library kernel, a TorchScript function), or None when an
        argument is one the native path does not resolve. Its fallback is this command
        list, resumed where the native run stopped (:meth:`resume`).

        A plan's windows share their program when their constants match (``programs``, the
        plan's: every window of a plan has the same ops, signatures and storage aliasing;
        :func:`_constants_key` holds what else a program bakes in): the later ones bind it to
        their own storages, found at the places the first window's were first met."""
        programs = self.programs
        key = None
        if programs is not None:
            key = _constants_key(self.records, self.off)
            if key is not None:
                found = programs.get(key)
                if found is not None:
                    program, places = found
                    records = self.records
                    return _native.bind(program, [getattr(records[r], kind)[k] for r, kind, k in places], self)
        builder = _native.ProgramBuilder()
        try:
            add_launches(builder, self.launches, self.records, self.off, _parts, interleave=True)
        except _native.NotNative:
            return None
        if key is None:
            return builder.launch(self)
        program, storages = builder.build()
        places = _places(self.records, storages)
        if places is not None:
            if len(programs) >= _PROGRAMS_PER_PLAN:  # constants that change window to window
                programs.clear()
            programs[key] = (program, places)
        return _native.bind(program, storages, self)


_PROGRAMS_PER_PLAN = 8


class _Uncacheable(Exception):
    pass


def _leaf_key(value):
    """What a program bakes in of one argument: nothing of a storage (bound per window), a
    view's place in its storage, a number's type, value and sign (0.0 and -0.0 are equal in
    Python), the object itself for the rest; a host tensor is a constant of its own window."""
    kind = type(value)
    if kind is DeviceStorage:
        return None
    if kind is float:
        return (float, value, math.copysign(1.0, value))
    if kind is int or kind is bool:
        return (kind, value)
    if kind is ViewRef:
        return (ViewRef, value.shape, value.stride, value.offset)
    if kind is list or kind is tuple:
        return (kind, *[_leaf_key(item) for item in value])
    if isinstance(value, torch.Tensor):
        raise _Uncacheable
    hash(value)  # (unhashable: not cached; any other reference hashes by identity: never shared)
    return value


def _constants_key(records, off):
    """The key of a window's program within its plan, or None when it cannot be shared."""
    try:
        return (off, *[(*[_leaf_key(value) for value in record.args],
                        *([(name, _leaf_key(value)) for name, value in record.kwargs.items()] if record.kwargs else ()))
                       for record in records])
    except (_Uncacheable, TypeError):
        return None


def _places(records, storages) -> tuple:
    """Where each of a program's storages is first met in its window: (record index,
    ``"reads"``/``"writes"``/``"results"``, position). Windows of one plan alias their
    storages alike, so the same places hold the storages of any of them."""
    first = {}
    for index, record in enumerate(records):
        for kind in ("reads", "writes", "results"):
            for position, storage in enumerate(getattr(record, kind)):
                if storage is not None and id(storage) not in first:
                    first[id(storage)] = (index, kind, position)
    try:
        return tuple(first[id(storage)] for storage in storages)
    except KeyError:  # a storage the records do not list: not shared
        return None


def _parts(record) -> tuple:
    return record.op, record.args, record.kwargs, record.results, record.writes


def add_launches(builder, launches, records, off, parts, generated=None, interleave=False) -> None:
    """Add a plan's launches to a ``ProgramBuilder``, in order: an op alone as one step, a
    fused kernel's ops with their registers freed after their last reader, a matched chain
    (on in this window: not in ``off``) as one library-kernel step. ``parts(record)`` ->
    ``(op, args, kwargs, results, writes)``: an ``OpRecord``'s, or a compiled graph's
    template record's, whose storages are slot numbers. Each step resumes, in Python, at
    its launch index << 20 | its offset in the launch (``WindowLaunches.resume``).
    ``generated`` (compiled mode): {launch index: (callable, inputs, results, written)}, a
    fused kernel's generated code, which the worker runs instead of its steps (they stay,
    for when it raises: ``executor.cpp``, struct Generated). ``interleave`` (adaptive
    windows): a fused kernel's runs of multi-tensor ops also as their steps parameter by
    parameter (``interleave.py``)."""
    for launch, (members, spec) in enumerate(launches):
        if spec is None:
            _add_op(builder, parts(records[members]), None, launch << 20)
            continue
        kernel_code = generated.get(launch) if generated else None
        if kernel_code is not None:
            builder.begin_group()
        kernel = [parts(records[index]) for index in members]
        at_root, skipped = _library_kernels(spec, {i for i in range(len(spec.patterns)) if (launch, i) in off})
        runs = interleaved_runs(kernel, skipped, at_root) if interleave and kernel_code is None else {}
        end = 0
        for offset, record in enumerate(kernel):
            if offset < end:
                continue  # (in the run just added)
            end = runs.get(offset, 0)
            if end:
                _add_interleaved(builder, kernel, spec, offset, end, launch << 20)
                continue
            if offset in skipped:
                continue
            pattern = at_root.get(offset)
            if pattern is not None:
                _add_library(builder, pattern, kernel, spec.dead, launch << 20 | pattern.members[0])
            else:
                _add_op(builder, record, spec.dead_at[offset], launch << 20 | offset)
            _free_after(builder, kernel, spec, offset)
        if kernel_code is not None:
            builder.generated(*kernel_code, launch << 20)


def _add_interleaved(builder, kernel, spec, start: int, end: int, base: int) -> None:
    """A run (``interleave.interleaved_runs``) as one step: its ops in PyTorch's order (run when
    the worker cannot reserve the run's memory), then the same ops parameter by parameter."""
    builder.begin_group()
    for offset in range(start, end):
        _add_op(builder, kernel[offset], spec.dead_at[offset], base | offset)
        _free_after(builder, kernel, spec, offset)
    builder.interleave()
    count = len(next(value for value in kernel[start][1] if type(value) is list))
    for index in range(count):
        for offset in range(start, end):
            op, args, kwargs, results, _ = kernel[offset]
            dead = spec.dead_at[offset]
            builder.op(op, [at_parameter(value, index) for value in args],
                       {name: at_parameter(value, index) for name, value in kwargs.items()} if kwargs else kwargs,
                       [results[index]] if results else results, (0,) if dead and index in dead else None, None,
                       base | start | BROKEN)
    builder.interleaved(base | start | BROKEN)


def _free_after(builder, kernel, spec, offset: int) -> None:
    """Free, after the step just added, the registers no op after ``offset`` reads."""
    frees = [kernel[producer][3][position] for producer, position in spec.last_uses[offset]]
    if frees:
        builder.free(frees)


def _add_op(builder, parts, dead, resume: int) -> None:
    op, args, kwargs, results, writes = parts
    builder.op(op, args, kwargs, results, dead, writes if id(op) in GUARDED_WRITES else None, resume)


def _add_library(builder, pattern, kernel, dead, resume: int) -> None:
    """A matched chain as one step: its library kernel's TorchScript function."""
    inputs = [kernel[offset][1][index] for offset, index in pattern.inputs]
    outputs = [kernel[offset][3][position] for offset, position in pattern.outputs]
    dead_positions = [i for i, place in enumerate(pattern.outputs) if place in dead]
    builder.script(library_function(pattern.impl), inputs, pattern.constants, outputs, dead_positions, resume)


def _library_kernels(spec, off) -> tuple:
    """``(at_root, skipped)``: each matched chain on in this launch, by the offset of its
    last op, where its library kernel runs; and the offsets of the ops it stands for."""
    at_root: dict = {}
    skipped: set = set()
    for index, pattern in enumerate(spec.patterns):
        if index not in off:
            at_root[pattern.root] = pattern
            skipped.update(pattern.members[:-1])
    return at_root, skipped


class FusedKernel:
    """One launch that runs several recorded ops (see module docstring)."""

    __slots__ = ("records", "spec", "stream", "off")

    def __init__(self, records, spec, stream: int, off=frozenset()) -> None:
        self.records = records
        self.spec = spec
        self.stream = stream
        self.off = off  # indices of spec.patterns whose constants differ in this launch

    @property
    def name(self) -> str:
        return self.spec.name

    def execute(self, queue) -> None:
        # with a fault injected, a failure pending or a poisoned input, every op by the
        # per-op failure rules, with no library kernel in between
        self._run_ops(queue, library=not queue.must_run_op_by_op(self.records))

    def resume(self, queue, start: int, env) -> None:
        """Run from op ``start`` with ``env`` (where a native run stopped), op by op under
        the failure rules. ``start`` with ``BROKEN``: the interleaved run from there raised
        after it began (``executor.cpp: run_interleaved``; no known cause: its every large
        block was reserved): parameters are at different ops, so the run fails at its first
        op with every tensor it writes poisoned, and the ops after it run by the rules."""
        if start & BROKEN:
            start &= ~BROKEN
            end = self._fail_run(queue, start, env)
            self._run_ops(queue, library=not queue.must_run_op_by_op(self.records), start=end, env=env)
            return
        self._run_ops(queue, library=not queue.must_run_op_by_op(self.records), start=start, env=env)

    def _fail_run(self, queue, start: int, env) -> int:
        records = self.records
        at_root, skipped = _library_kernels(self.spec, self.off)
        end = interleaved_runs([_parts(record) for record in records], skipped, at_root).get(start, start + 1)
        record = records[start]
        error = RuntimeError(
            f"{record.name} raised while the device ran a run of multi-tensor ops parameter by parameter "
            f"({end - start} ops: an optimizer step); every tensor the run writes is poisoned")
        written = [storage for each in records[start:end] for storage in (*each.writes, *each.results)
                   if storage is not None]
        queue.fail(record.failure(error, self.spec.name, queue.completed + 1, env), written)
        queue.report_failed_kernel(self.spec.signature)
        return end

    def _run_ops(self, queue, library: bool = True, start: int = 0, env=None) -> bool:
        """Run the ops in program order, dead intermediates in ``env``; each matched chain
        as its library kernel at its last op (``library``), unless it is off in this
        launch. True if an op failed (the queue then has the kernel's signature)."""
        env: dict = {} if env is None else env
        spec = self.spec
        last_uses = spec.last_uses
        dead_at = spec.dead_at
        records = self.records
        at_root, skipped = _library_kernels(spec, self.off) if library else ({}, set())
        failed = False
        name = spec.name
        for offset, record in enumerate(records):
            if offset < start:
                continue
            if offset in skipped:
                pass
            elif offset in at_root:
                pattern = at_root[offset]
                if not self._run_library(pattern, env):
                    # the library kernel raised: its ops, one by one, name the failing one
                    for member in pattern.members:
                        failed = run_record(records[member], queue, env, dead_at[member], name) or failed
            else:
                failed = run_record(record, queue, env, dead_at[offset], name) or failed
            for producer, position in last_uses[offset]:  # free registers no later op reads
                env.pop(records[producer].results[position], None)
        if failed:
            queue.report_failed_kernel(spec.signature)
        return failed

    def _run_library(self, pattern, env: dict) -> bool:
        """A matched chain's library kernel; False (run its ops instead) if it raises."""
        records = self.records
        dead = self.spec.dead
        try:
            inputs = [resolve(records[offset].args[index], env) for offset, index in pattern.inputs]
            result = library_function(pattern.impl)(*inputs, **pattern.constants)
            values = (result,) if isinstance(result, torch.Tensor) else tuple(result)
            for (offset, position), value in zip(pattern.outputs, values):
                storage = records[offset].results[position]
                if (offset, position) in dead:
                    env[storage] = in_layout(storage, value)
                else:
                    storage.adopt(value)
        except Exception:  # noqa: BLE001
            return False
        return True
