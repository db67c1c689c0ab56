"""Replaying a compiled graph's call without running its FX code: no per-op dispatch.

Entry points: :func:`input_signature` (a call's inputs -> the key its replay is cached
under), :class:`Recording` (watches the one call that records a template) and
:class:`Template` (what that call did, replayed for later calls with the same signature).

A compiled graph's first call with a given input signature (each input's shape, stride,
dtype, offset and which inputs share storage; autocast's state) runs its FX code: every
aten op goes through the device's per-op path (dispatch, shape inference, an
``OpRecord``) into the graph-sized window, which is flushed once. That call is recorded
as a *template*: every storage its ops touch becomes a *slot* (an input's storage, a
constant the graph holds, or one the call allocates), each record keeps its op, arguments
(storages as slots), cost, shape-inference key and FX location, and each output says how
it is made (an input as it is, a tensor over an allocated slot, a view of one).

A later call with the same signature skips the FX code: it allocates the slots afresh
(memory booked as the per-op path books it), makes the outputs (the C++ ``empty``), binds
the new storages into copies of the records (issue numbers, stream and simulated host
time as if issued) and hands them to the same window's flush. So the flush is the
ordinary one: the plan-cache key is rebuilt from the new storages (which outputs escape,
whether written inputs are still referenced), the cached plan and kernels launch on the
same queue with the same cost accounting, trace, statistics and failure rules, and a
failing kernel names the user's line through the record's FX location, as recorded.

Calls the template cannot stand for run the FX code again, and the reason is counted
(``stats()["compiled"]["replay_fallbacks"]``): a call that synced, fell back to the CPU,
drew random numbers, returned host tensors or computed host tensors it could not split
off (``host_split.py``), changed an input's metadata, or ran
the graph as traced because mutated inputs alias; ``NEURON_LAUNCH_BLOCKING`` (each op waits
for the device, and raises inside the call) always runs the FX code. Fault injection
replays: faults strike on the device worker. Under ``torch.profiler`` a call replays too
(the profile shows what runs unprofiled): its ops, issued without their aten calls, are
tied to the torch op around the call (``CompiledFunction`` or Dynamo's compiled-region
range), which gets their kernels' device time and flows.
``NEURON_COMPILED_REPLAY=0`` turns replay off.
"""
from __future__ import annotations

import torch

from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.hardware.execution_queue import QUEUE
from adaptive_eager_device.hardware.profiler import PROFILER
from adaptive_eager_device.hardware.profiler import issued_all as profiler_issued_all
from adaptive_eager_device.memory.storage import (
    MEMORY, DeviceStorage, rounded_nbytes,
)
from adaptive_eager_device.hardware.streams import STATE as _STREAMS
from adaptive_eager_device.memory.tensor import describe, storage_of

from adaptive_eager_device import _C as _native
from adaptive_eager_device.hardware.fused_kernel import WindowLaunches, add_launches
from adaptive_eager_device.hardware.plan import library_kernels_off

from . import generated
from .replay_records import Fresh as _Fresh, NotReplayable, RecordTemplate, Slot
from .window import structure_key

_SCALARS = (int, float, bool, type(None))


def input_signature(args):
    """``(key, storages)`` of a call's inputs, or ``(reason, None)`` when an input is one a
    template cannot bind (a host tensor, a generator). ``storages[k]`` is input k's
    DeviceStorage (None for a non-tensor). In C when every input is a neuron tensor or a
    number (``_C.input_signature``, the same key); here otherwise."""
    enabled, dtype = torch.is_autocast_enabled("neuron"), torch.get_autocast_dtype("neuron")
    if type(args) is list:
        answer = _native.input_signature(args, enabled, dtype, storage_of)
        if answer is not None:
            return answer
    key = [enabled, dtype]
    storages = []
    numbers: dict = {}
    for value in args:
        described = describe(value)
        if described is None:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                key.append(("host", value.shape, value.stride(), value.dtype))
            elif type(value) in _SCALARS:
                key.append((type(value), value))
            else:
                return "an input a template cannot bind", None
            storages.append(None)
            continue
        signature, storage, covers = described
        if storage is None:
            storage = storage_of(value)
        number = numbers.get(storage)
        if number is None:
            number = numbers[storage] = len(numbers)
        key.append((signature, number) if covers else
                   (signature, number, value.storage_offset(), value.is_conj(), value.is_neg()))
        storages.append(storage)
    return tuple(key), storages


class Recording:
    """Watches the call that records a template: what would make it unreplayable."""

    def __init__(self, args, storages) -> None:
        self.storages = storages
        # the host tensor inputs (held: their ids identify them in the snapshots)
        self.host_inputs = [value if storage is None and isinstance(value, torch.Tensor) else None
                            for value, storage in zip(args, storages)]
        self.snapshots: dict = {}  # recorder.HOST_SNAPSHOTS while the call runs
        self.early_flushes = 0
        self.records = None  # the window's records at the "graph" flush
        self.allocations = MEMORY.allocations
        self.ops = COUNTERS.ops_recorded
        self.host_runs = sum(COUNTERS.fallback_ops.values()) + sum(COUNTERS.sync_points.values())

    def capture(self, records) -> None:
        self.records = list(records)


class Template:
    """One recorded call of a graph, replayable for calls with the same input signature
    (module docstring)."""

    __slots__ = ("slots", "records", "outputs", "ops", "table", "inputs", "hosts", "escaping",
                 "fresh_slots", "skeleton", "written", "programs", "jobs", "binder", "memo")

    def __init__(self, recording: Recording, outputs, args_after, gm) -> None:
        records = recording.records
        if recording.early_flushes:
            raise NotReplayable("the graph flushed early (a sync point, CPU fallback or barrier)")
        if records is None:
            raise NotReplayable("no op reached the window")
        if COUNTERS.ops_recorded - recording.ops != len(records):
            raise NotReplayable("ops reached the device outside the window")
        if sum(COUNTERS.fallback_ops.values()) + sum(COUNTERS.sync_points.values()) != recording.host_runs:
            raise NotReplayable("the graph ran ops on the host (a CPU fallback or a sync point)")
        self.slots: list = []  # per slot: ("input", k) | ("constant", storage) | _Fresh
        index: dict = {}
        for k, storage in enumerate(recording.storages):
            if storage is not None and storage not in index:
                index[storage] = len(self.slots)
                self.slots.append(("input", k))
        host_inputs = {id(value): k for k, value in enumerate(recording.host_inputs) if value is not None}
        host_slots: dict = {}  # host input -> its slot, made when a record reads it
        constants = {storage_of(t) for t in _constants(gm)}
        output_storages = _output_storages(outputs)
        produced = {s for record in records for s in record.results if s is not None}
        fresh = 0

        def slot(storage) -> Slot:
            nonlocal fresh
            number = index.get(storage)
            if number is None:
                number = index[storage] = len(self.slots)
                if storage in constants:
                    self.slots.append(("constant", storage))
                else:
                    if storage not in produced:
                        fresh += 1  # allocated by the call (empty): checked below
                    if storage not in output_storages and storage.alive:
                        raise NotReplayable("an intermediate is still referenced after the call")
                    self.slots.append(_Fresh(storage, storage in output_storages))
            return Slot(number)

        def host(snapshot):
            """A host tensor argument: a snapshot of a host input, taken again at each
            replay, or a constant (no host input: nothing else on the host can vary)."""
            original = recording.snapshots.get(id(snapshot))
            k = host_inputs.get(id(original))
            if k is not None:
                number = host_slots.get(k)
                if number is None:
                    number = host_slots[k] = len(self.slots)
                    self.slots.append(("host", k))
                return Slot(number)
            if host_inputs:
                raise NotReplayable("a host tensor the graph computed on the host")
            return snapshot

        self.records = tuple(RecordTemplate(record, slot, host) for record in records)
        self.outputs = tuple(_output_specs(outputs, recording.storages, args_after, slot))
        allocated = MEMORY.allocations - recording.allocations
        if allocated != len(produced) + fresh:
            raise NotReplayable("the call allocated storages its records do not account for")
        self.ops = len(self.records)
        self._plan_binding()
        self._plan_structure()
        self._plan_native()
        self.programs: dict = {}  # Plan -> (native program, library kernels off), or None
        self.jobs: dict = {}  # Plan -> its fused kernels being generated (generated.py)

    def _plan_binding(self) -> None:
        """What ``bind`` does at every call, sorted once: the constants' table (one entry
        per slot, and a last one, None, for the results a record does not make), where
        inputs and host inputs go, and the fresh storages' layouts, booked together (the
        C side's ``FreshSlots``: storages for those an output escapes through, cells alone
        for the others, the call's intermediates)."""
        self.table = [None] * (len(self.slots) + 1)
        inputs, hosts, fresh, layouts = [], [], [], []
        for number, slot in enumerate(self.slots):
            if type(slot) is _Fresh:
                fresh.append((number, slot))
                layouts.append((number, slot.shape, slot.stride, slot.dtype, rounded_nbytes(slot.nbytes), slot.escapes))
            elif slot[0] == "input":
                inputs.append((number, slot[1]))
            elif slot[0] == "host":
                hosts.append((number, slot[1]))
            else:
                self.table[number] = slot[1]
        self.inputs, self.hosts = tuple(inputs), tuple(hosts)
        self.escaping = tuple((number, slot) for number, slot in fresh if slot.escapes)
        self.fresh_slots = DeviceStorage.fresh_slots(layouts, len(self.table))

    def _plan_structure(self) -> None:
        """The window's plan-cache key (``window.structure_key``) as far as every call
        shares it: the slots' aliasing is fixed by the input signature, and so is whether
        a storage the call makes escapes (an output's is referenced, another's is not).
        Only a write to an input or a constant depends on the call (is that storage still
        referenced?): ``written`` lists those entries, which ``structure`` fills in."""
        slots = self.slots

        def referenced(n):
            slot = slots[n]
            return slot.escapes if type(slot) is _Fresh else None

        ops = [(template.signature_id, reads, writes, [None if n == -1 else n for n in results])
               for template in self.records for reads, writes, results in (template.numbers,)]
        self.skeleton, self.written = structure_key(ops, referenced)
        self.written = tuple(self.written)

    def _plan_native(self) -> None:
        """A call's binding in one C call (``_C.ReplayBinder.call(args, storages,
        capacity)`` -> ``(table, cells, outputs)``, or None when its storages do not fit):
        the slot table (input storages, constants, a copy of each host input, the fresh
        storages; an intermediate's entry stays None, its cell in the ``FreshCells``:
        ``cells.wrap(table)`` makes its storage where Python needs it) and the outputs as
        the recorded call made them; and the memo of the last plan found (``plan_for``)."""
        self.memo = None
        bases = [(number, slot.shape, slot.stride, slot.dtype, slot.nbytes) for number, slot in self.escaping]
        self.binder = _native.ReplayBinder(self.fresh_slots, self.table, list(self.inputs), list(self.hosts), bases,
                                           list(self.outputs), [n for _, n in self.written])

    def plan_for(self, table, cache):
        """This call's plan in ``cache`` (the graph window's plan cache), found as a lookup
        of ``structure(table)`` finds it; the last one found is found again without building
        or hashing the key while its written inputs' ``alive`` bits are the same and the cache
        has not changed (``CountingLRU.relookup``: counted as that lookup)."""
        bits = self.binder.alive_bits(table)
        memo = self.memo
        if memo is not None and memo[0] == bits:
            plan = cache.relookup(memo[1])
            if plan is not None:
                return plan
        plan, ticket = cache.lookup_ticket(self.structure(table))
        self.memo = (bits, ticket) if bits >= 0 and ticket is not None else None
        return plan

    def structure(self, table) -> tuple:
        """This call's plan-cache key: ``AdaptiveSink._structure`` of its records."""
        parts = self.skeleton.copy()
        for at, n in self.written:
            if not table[n].alive:
                parts[at] = ~parts[at]
        return tuple(parts)

    def program(self, plan, table=None):
        """``(program, off)``: this template's ops as one native program for ``plan`` (its
        storages the template's slots, bound to each call's: ``_C.bind``) and the library
        kernels its constants turn off, built once per plan; None when an argument is one
        the native path does not resolve. The first build asks for the plan's fused kernels
        as generated code (``generated.py``, compiled in the background from the slots'
        layouts in this call's ``table``); once they are compiled, the program is built
        again with them."""
        found = self.programs.get(plan, False)
        if found is False:
            found = self._build(plan, None)
            self.programs[plan] = found
            if found is not None and table is not None:  # (an intermediate's layout is its slot's)
                layouts = [self.slots[n] if entry is None and n < len(self.slots) else entry for n, entry in enumerate(table)]
                job = generated.request(self.records, plan, layouts)
                if job is not None:
                    self.jobs[plan] = job
        elif self.jobs:
            job = self.jobs.get(plan)
            if job is not None and job.kernels is not None:
                del self.jobs[plan]
                if job.kernels and CONFIG.compiled_inductor:
                    found = self.programs[plan] = self._build(plan, job.kernels)
        return found

    def _build(self, plan, kernels):
        records = self.records
        off = library_kernels_off(plan, [_Constants(template) for template in records]) if plan.library else frozenset()
        builder = _native.ProgramBuilder()
        builder.numbered(len(self.table))
        try:
            add_launches(builder, plan.launches, records, off, _template_parts, kernels)
            return (builder.build()[0], off)
        except _native.NotNative:
            return None

    def issue(self, table) -> list:
        """Copies of the records over the call's storages, issued now."""
        stream = _STREAMS.current
        issue = QUEUE.issue_ops(len(self.records))  # the simulated host, as if issued op by op
        records = []
        append = records.append
        for template in self.records:
            issue += 1
            append(template.bind(table, stream, issue))
        COUNTERS.ops_recorded += len(records)  # ops that reached the device, as the per-op path counts them
        if PROFILER._is_profiler_enabled:
            profiler_issued_all(records)
        trace = QUEUE.trace_recorder
        if trace is not None:
            from time import perf_counter

            for record in records:
                trace.issue(record, perf_counter())
        return records


class _Constants:
    """A template record as the constant checks read it (its arguments)."""

    __slots__ = ("args",)

    def __init__(self, template) -> None:
        self.args = template.marked_args


def _template_parts(template) -> tuple:
    reads, writes, results = template.numbers
    return template.op, template.marked_args, template.kwargs, results, writes


class ReplayedCall:
    """A replayed call's native launch's fallback: its records, made from the template
    only if the worker hands the launch back (a failure pending, a fault injected, a
    poisoned input, a step that raised), then run from where the native run stopped."""

    __slots__ = ("template", "table", "stream", "first", "plan", "off")

    def __init__(self, template, table, stream: int, first: int, plan, off) -> None:
        self.template, self.table, self.stream, self.first, self.plan, self.off = template, table, stream, first, plan, off

    def resume(self, queue, resume: int, env) -> None:
        table, stream, first = self.table, self.stream, self.first
        records = [template.bind(table, stream, first + index + 1) for index, template in enumerate(self.template.records)]
        WindowLaunches(self.plan.launches, records, stream, self.off).resume(queue, resume, env)


def _constants(gm):
    """The neuron tensors a graph module holds (``get_attr`` constants)."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor) and describe(value) is not None:
                found.append(value)
    return found


def _output_storages(outputs) -> set:
    found = set()
    for value in outputs:
        described = describe(value)
        if described is not None:
            found.add(described[1] if described[1] is not None else storage_of(value))
    return found


def _output_specs(outputs, storages, args, slot):
    """How each output is made at a replay (``_C.ReplayBinder``)."""
    seen: dict = {}
    inputs = {id(value): k for k, value in enumerate(args) if isinstance(value, torch.Tensor)}
    for position, value in enumerate(outputs):
        if id(value) in seen:
            yield ("same", seen[id(value)])
            continue
        seen[id(value)] = position
        if id(value) in inputs:
            yield ("input", inputs[id(value)])
            continue
        described = describe(value)
        if described is None:
            if type(value) not in _SCALARS:
                raise NotReplayable("the graph returns a host tensor or an object")
            yield ("value", value)
            continue
        signature, storage, covers = described
        storage = storage if storage is not None else storage_of(value)
        if signature[2] is not storage.dtype or value.is_conj() or value.is_neg():
            raise NotReplayable("an output reinterprets its storage")
        yield ("tensor", slot(storage).n, signature[0], signature[1], value.storage_offset(), covers)
