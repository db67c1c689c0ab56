"""Fused kernels on the device worker: a planned window's launches, run as one command list.

Entry points: :class:`WindowLaunches` (a flushed window's launches, one queue item),
:class:`FusedKernel` (one launch that runs several recorded ops) and :func:`built_counts`
(how many of a kernel cache's kernels are built, and how many stay op by op).

The device executes a plan it is handed as data and never plans: the plan format is
``plan.py`` (``Plan``, ``KernelSpec``, ``PatternSpec``), which the planner
(``adaptive_eager.fusion``) builds; this module imports nothing of the planner, so
``adaptive_eager_device`` still imports alone. A window comes with the library kernels
its constants turn off for this launch (``plan.library_kernels_off``, checked once on the
host at hand-over): those chains run op by op, and the kernel is not built from them.

A fused kernel runs its ops back to back on the device worker, in program order, keeping
its *dead intermediates* in an environment instead of device memory: an output produced
and consumed inside the kernel, with no live Python reference and no view at flush, is
never written back. Each op runs through ``op_record.run_record``, the per-op runner that
strict launches use too; a matched chain runs as one library kernel at its last op.

What a kernel's launches change lives here, never on the plan: :data:`STATE` (a weak
table, ``KernelSpec`` -> :class:`KernelState`) counts its launches and keeps its built
function (``device/hardware/built_kernel.py``) once it is hot, or False when it cannot be built.

When an op inside fails, the rest of the kernel runs op by op with strict eager's rules
(ops reading a poisoned buffer are skipped), the deferred error names the exact op and
the user's line, and the kernel's signature goes to the queue
(``ExecutionQueue.report_failed_kernel``), which hands it to the runtime at its next
flush (``take_failed_kernels``): the runtime marks the chain unfusable.
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..core.config import CONFIG
from . import built_kernel
from .op_record import in_layout, resolve, run_record

LOG = logging.getLogger("adaptive_eager.fusion")


class KernelState:
    """What one fused kernel's launches changed: how many ran, and its built function
    (None until it is hot, False when it cannot be built)."""

    __slots__ = ("launches", "built")

    def __init__(self) -> None:
        self.launches = 0
        self.built = None


# KernelSpec -> KernelState, written by the device worker only; an entry goes with its
# spec (evicted from its kernel cache, invalidated after a failure, cleared)
STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def built_counts(specs) -> tuple:
    """``(built, op_by_op)``: how many of ``specs`` run as one built function, and how
    many were tried and stay op by op."""
    states = [STATE.get(spec) for spec in specs]
    return (
        sum(1 for state in states if state is not None and state.built),
        sum(1 for state in states if state is not None and state.built is False),
    )


class WindowLaunches:
    """A flushed window's launches, in plan order, as one queue item: the host hands the
    device a command list (accounted kernel by kernel, ``ExecutionQueue.launch_batch``),
    and the device worker builds the fused kernels and runs them in order. ``launches`` is
    ``Plan.launches``: ``(position, None)`` for an op alone, ``(positions, KernelSpec)``."""

    __slots__ = ("launches", "records", "stream", "off")

    def __init__(self, launches, records, stream: int, off=frozenset()) -> None:
        self.launches = launches
        self.records = records
        self.stream = stream
        self.off = off  # {(launch index, pattern index)}: library kernels off in this window

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
        # Release each kernel's records once it has run, as strict eager drops each op:
        # a buffer no later kernel reads is freed now, and its memory is reused by the
        # next allocation instead of the window's footprint growing to its sum.
        records = self.records
        for launch, (members, spec) in enumerate(self.launches):
            if spec is None:
                kernel = records[members]
                records[members] = None
            else:
                kernel = self._fused(launch, members, spec)
                for index in members:
                    records[index] = None
            kernel.execute(queue)
            kernel = None


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
        if queue.must_run_op_by_op(self.records):
            self._run_ops(queue, library=False)  # the per-op failure rules: faults, drops, poison
            return
        spec = self.spec
        state = STATE.get(spec)
        if state is None:
            state = STATE[spec] = KernelState()
        built = state.built
        if built is None and CONFIG.build_kernels:
            state.launches += 1
            if state.launches >= built_kernel.HOT_AFTER:
                self._build_and_run(queue, state)
                return
        elif built and self._run_built(built):
            return
        self._run_ops(queue)

    def _run_ops(self, queue, library: bool = True) -> bool:
        """Run the ops in program order, dead intermediates in ``env``; each matched chain
        as its library kernel at its last op (``library``), unless it is off in this
        launch. True if an op failed (the queue then has the kernel's signature)."""
        env: dict = {}
        spec = self.spec
        last_uses = spec.last_uses
        dead_at = spec.dead_at
        records = self.records
        at_root: dict = {}
        skipped: set = set()
        if library:
            off = self.off
            for index, pattern in enumerate(spec.patterns):
                if index not in off:
                    at_root[pattern.root] = pattern
                    skipped.update(pattern.members[:-1])
        failed = False
        name = spec.name
        for offset, record in enumerate(records):
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
            result = pattern.impl(*inputs, **pattern.constants)
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

    def _run_built(self, built) -> bool:
        """The built kernel: one call. False (run op by op instead, which names the op
        that fails) when it raises; it writes nothing in place, so replaying is safe."""
        if self.off:  # a library kernel it was built with is off in this launch
            return False
        records = self.records
        try:
            values = built.run(records)
            for (offset, position), value in zip(built.outputs, values):
                records[offset].results[position].adopt(value)
        except Exception:  # noqa: BLE001
            return False
        return True

    def _build_and_run(self, queue, state: KernelState) -> None:
        """Build the hot kernel, run it beside the op-by-op run of this same launch, and
        keep it only if its outputs are bit-identical (``device/hardware/built_kernel.py``)."""
        spec = self.spec
        if self.off:
            self._run_ops(queue)  # its library kernels' constants differ this time: build later
            return
        built = built_kernel.build(self.records, spec)
        values = None
        if built is not None:
            try:
                values = built.run(self.records)  # no side effects: nothing in place
            except Exception as error:  # noqa: BLE001
                LOG.debug("built kernel %s raised (%s): it stays op by op", spec.name, error)
        failed = self._run_ops(queue)
        if values is not None and not failed and built_kernel.same_outputs(values, self.records, built.outputs):
            state.built = built
        else:
            if values is not None and not failed:
                LOG.debug("built kernel %s differs from its ops: it stays op by op", spec.name)
            state.built = False
