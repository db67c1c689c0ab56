"""The IR record of one recorded op, and how it runs as a kernel on the device worker.

Entry points: :class:`OpRecord`, one aten op as the host recorded it, and
:func:`run_record`, the one place where a recorded op runs on the device worker under the
queue's failure rules. In strict eager a record is itself one launch
(``OpRecord.execute``); the adaptive runtime groups records into fused kernels
(``device/hardware/fused_kernel.py``) that call ``run_record`` for each op in turn.

The failure rules (docs/ARCHITECTURE.md, "Errors"): while a failure is pending (recorded,
not yet raised at a sync point), every op issued after the failing op is *dropped*: it
does not run, its fresh outputs are poisoned, and what it would have updated in place
keeps its value. An op that reads a poisoned tensor fails with an error naming the
original failure. A failing op's outputs are poisoned; the tensors it updates in place
keep their last good values when ATen could have written part of them before raising
(index- and mask-driven writes: they are copied first, ``GUARDED_WRITES``), and are
poisoned otherwise (their contents are unknown).

Tensor arguments of a record are *references*: a :class:`DeviceStorage` for a whole
allocation (resolved to its CPU backing tensor when the kernel runs, since the producer may
not have run yet at record time), or a CPU tensor view for views, whose base the host
allocated in order to alias it.
"""
from __future__ import annotations

import torch

from .. import _C as _native
from ..core.errors import KernelFailure, describe_call, poisoned_read_error
from ..memory.storage import DeviceStorage, ReinterpretRef, ViewRef

_Tensor = torch.Tensor
# id(op) of in-place ops that check their index or mask data while they write: a failure
# may leave part of the target written, so the target is copied before they run
GUARDED_WRITES: set = set()


def resolve(value, env=None):
    """Turn a recorded argument into what the CPU kernel takes.

    ``env`` maps storages to tensors that a fused kernel keeps in registers instead of
    device memory; everything else resolves to the storage's backing tensor.
    """
    kind = type(value)
    if kind is DeviceStorage:
        if env is not None:
            tensor = env.get(value)
            if tensor is not None:
                return tensor
        data = value.data
        return data if data is not None else value.materialize()
    if kind is ViewRef or kind is ReinterpretRef:
        return value.resolve(resolve(value.storage, env))
    if kind is list or kind is tuple:
        if env:
            items = [resolve(item, env) for item in value]
        else:  # a foreach op's storages, inline: its lists are what the worker resolves most
            items = [
                (item.data if item.data is not None else item.materialize()) if type(item) is DeviceStorage
                else resolve(item) for item in value
            ]
        return items if kind is list else tuple(items)
    return value


def flatten_results(result) -> tuple:
    if isinstance(result, torch.Tensor) or result is None:
        return (result,)
    return tuple(result)


class OpRecord:
    """One aten op, recorded on the host. Frozen once built.

    - ``args``/``kwargs``: the call, with tensor references (see module docstring);
      ``nested`` is True when an argument needs more than a storage lookup to resolve (a
      list holding references, as for ``cat``, or a view);
    - ``reads``: storages the op reads; ``writes``: storages it writes in place;
    - ``results``: fresh storages for its outputs, in return order (None where the op
      returns no tensor);
    - ``cost``: an ``OpCost`` from the cost model;
    - ``signature``: the op and its argument metadata; ``signature_id``: a small number standing for
      it (never reused), the unit of the plan cache's keys;
    - ``location``: the user's line that issued it (raw; ``location.source_location`` formats);
    - ``issue``: its place in issue order (``ExecutionQueue.issued``), which decides which
      failure is the earliest and which ops a failure drops, whatever the fusion;
    - ``profile_id``: its handle in a ``torch.profiler`` session (``device/hardware/profiler.py``),
      set only while a profiler records (read with a default: unset costs nothing per op).
    """

    __slots__ = (
        "op", "args", "kwargs", "nested", "reads", "writes", "results", "location", "cost", "signature",
        "signature_id", "stream", "trace_id", "issue", "profile_id",
    )

    def __init__(self, op, args, kwargs, nested, reads, writes, results, location, cost, signature, signature_id, stream, issue):
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.nested = nested
        self.reads = reads
        self.writes = writes
        self.results = results
        self.location = location
        self.cost = cost
        self.signature = signature
        self.signature_id = signature_id
        self.stream = stream
        self.trace_id = 0  # set by the timeline (device/hardware/trace.py) while tracing
        self.issue = issue

    @property
    def name(self) -> str:
        return self.op._schema.name

    def run(self, env=None):
        """Run the op on CPU tensors and return its raw result.

        A storage read here holds data written by an earlier kernel on the FIFO queue,
        uploaded by the host, or none yet (a fresh ``empty`` that this op writes, as an
        upload's copy does): its bytes are made now. ``env`` holds the values a fused
        kernel keeps in registers.
        """
        if not self.nested:
            args = []
            append = args.append
            for a in self.args:
                if type(a) is DeviceStorage:
                    if env and a in env:
                        append(env[a])
                    else:
                        data = a.data
                        append(data if data is not None else a.materialize())
                else:
                    append(a)
        else:
            args = resolve(self.args, env)
        kwargs = self.kwargs
        if kwargs:
            return self.op._op(*args, **{k: resolve(v, env) for k, v in kwargs.items()})
        return self.op._op(*args)

    def failure(self, error: BaseException, kernel_name=None, sequence=0, env=None) -> KernelFailure:
        try:
            call = describe_call(self.name, resolve(self.args, env), {k: resolve(v, env) for k, v in self.kwargs.items()})
        except Exception:  # describing must never hide the real failure
            call = self.name
        return KernelFailure(self.name, call, self.location, kernel_name, error, sequence, self.issue)

    def __repr__(self) -> str:
        return f"OpRecord({self.name})"


def _store(record, result, env, dead) -> None:
    """Hand each output to its storage (no copy when possible), or keep it in the fused
    kernel's registers (``env``) when its position is in ``dead``."""
    results = record.results
    if isinstance(result, torch.Tensor):
        storage = results[0] if results else None
        if storage is not None:
            if dead and 0 in dead:
                env[storage] = in_layout(storage, result)
            else:
                storage.adopt(result)
        return
    for position, value in enumerate(flatten_results(result)):
        storage = results[position] if position < len(results) else None
        if storage is not None and value is not None:
            if dead and position in dead:
                env[storage] = in_layout(storage, value)
            else:
                storage.adopt(value)


def in_layout(storage, value):
    """A value kept in registers, in its storage's layout (views of it resolve with
    ``as_strided``)."""
    if value.stride() != storage.stride or value.storage_offset() != 0:
        value = torch.empty_strided(storage.shape, storage.stride, dtype=storage.dtype).copy_(value)
    return value


def run_record(record, queue, env=None, dead=None, kernel_name=None) -> bool:
    """Run one recorded op on the device worker under the failure rules (module
    docstring). ``env`` and ``dead`` are a fused kernel's registers and the result
    positions of this op it keeps there. Returns True when the op itself raised."""
    first = queue.failures.first
    if first is not None and first.issue < record.issue:
        # issued after a pending failure: it does not happen. What it would have written
        # in place keeps its value, unless it holds none yet (an upload's fresh target):
        # that would read as uninitialized memory, so it is poisoned too.
        queue.drop(record.results)
        for storage in record.writes:
            if storage.data is None:
                storage.poison = first
        return False
    if queue.poison_seen:
        for storage in record.reads:
            if storage.poison is not None:
                error = poisoned_read_error(storage.poison)
                queue.fail(record.failure(error, kernel_name, queue.completed + 1, env), record.results)
                return False  # a failure, but not of this kernel's making
    if queue.faults is not None:
        try:
            queue.faults.check(record.name)
        except Exception as error:  # an injected fault strikes before the kernel runs
            queue.fail(record.failure(error, kernel_name, queue.completed + 1, env), record.results)
            return True
    saved = None
    if record.writes and id(record.op) in GUARDED_WRITES:
        saved = [(storage, storage.materialize().clone()) for storage in record.writes]
    try:
        result = record.run(env)
        results = record.results
        if not dead and type(result) is _Tensor and results and results[0] is not None:
            results[0].adopt(result)  # the common case, inline
        else:
            _store(record, result, env, dead)
    except Exception as error:
        if saved is not None:
            for storage, value in saved:
                storage.data.copy_(value)
            written = record.results
        else:
            written = (*record.writes, *record.results)
        queue.fail(record.failure(error, kernel_name, queue.completed + 1, env), written)
        return True
    return False


OpRecord.execute = run_record  # strict eager: one record is one launch, run by the same rules


def _resume(record, queue, resume: int, env) -> None:
    """A native launch of this one op handed back to Python (``executor.cpp``): it runs
    here, by the failure rules. ``resume`` with ``BROKEN``: the worker ran it with the
    launches beside it parameter by parameter (``interleave.py``) and one raised after the
    run began (no known cause: every large block was reserved), so its parameters are at
    different ops: it fails, every tensor it writes poisoned."""
    if resume & _native.BROKEN:
        error = RuntimeError(
            f"{record.name} raised while the device ran a run of multi-tensor launches parameter by "
            "parameter (an optimizer step); every tensor the run writes is poisoned")
        queue.fail(record.failure(error, None, queue.completed + 1), (*record.writes, *record.results))
        return
    run_record(record, queue)


OpRecord.resume = _resume


def native_launch(record):
    """``record`` as one native launch (``device/csrc/executor.cpp``: the worker runs it in
    C++, with no Python), or the record itself, a Python item, when an argument is one the
    native path does not resolve (another dtype over a storage's bytes)."""
    try:
        return _native.native_op(record.op, record.args, record.kwargs, record.results,
                                 record.writes if id(record.op) in GUARDED_WRITES else None, record)
    except _native.NotNative:
        return record
