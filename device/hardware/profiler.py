"""torch.profiler's view of the device: what the device tells the extension's Kineto child
profiler (``device/csrc/profiler.cpp``) while a profile records ``ProfilerActivity.PrivateUse1``.

Entry points: :func:`issued` (an op reached the device), :func:`launched` and
:func:`launched_window` (kernel launches), :func:`host_kernel` (a launch the host runs
itself: a data-dependent op, a collective), :func:`wait_begin` / :func:`wait_end` (a host
wait for the device). Callers guard each call with ``PROFILER._is_profiler_enabled`` (a
module global of ``torch.autograd.profiler``, True while any torch profiler records): with
no profiler, that one read is the whole cost, per op and per launch. With a CPU-only
profile the calls return at once (no session records).

Per op, on the issuing host thread, inside the aten op (``recorder.record_kernel``; a
compiled graph's replay, ``Template.issue``): the op's handle (``record.profile_id``),
which ties it to the innermost torch op being recorded on that thread. Per launch, on the
host, in queue order (``ExecutionQueue.launch``, ``launch_batch``, ``account``): the
kernel's name (as the statistics name it: the op, or the fused chain), its simulated
duration (the cost model's), its stream and its ops' handles with their own cost-model
times (a fused kernel's op gets that share of the kernel). The C++ side lays the kernel on
the device lane at ``max(now, end of the previous kernel)`` for its simulated duration,
and at the end of the profile turns all of it into Kineto activities (module docstring
of ``profiler.cpp``). Nothing runs on the device worker.
"""
from __future__ import annotations

import torch.autograd.profiler as PROFILER

from .. import _C as _native

__all__ = ["PROFILER", "issued", "issued_all", "launched", "launched_window", "host_kernel", "wait_begin", "wait_end"]

_op_issued = _native.profiler_op_issued
_kernel_launched = _native.profiler_kernel_launched
_NativeLaunch = _native.NativeLaunch


def _name(key) -> str:
    """A launch's name as ``ExecutionQueue.kernel_summary`` (hence ``stats()["kernels"]``)
    names it: the op's schema name, or the fused kernel's name."""
    return key if type(key) is str else key._schema.name


def issued(record) -> None:
    """``record`` (an ``OpRecord``) reached the device: inside its aten op, on the host."""
    record.profile_id = _op_issued(record.op._schema.name)


def issued_all(records) -> None:
    """Ops issued together without their aten calls (a compiled graph's replay): each is
    tied to the innermost torch op being recorded now (the compiled call's)."""
    for record in records:
        record.profile_id = _op_issued(record.op._schema.name)


def _records_of(kernel):
    if type(kernel) is _NativeLaunch:  # one strict op's: its record
        kernel = kernel.fallback
    records = getattr(kernel, "records", None)  # a FusedKernel; an OpRecord is its own
    return (kernel,) if records is None else records


def _launch(name: str, time_us: float, stream: int, records) -> None:
    _kernel_launched(
        name, time_us, stream,
        [getattr(record, "profile_id", 0) for record in records],  # 0: issued while no session recorded
        [record.cost.time_us for record in records],
    )


def launched(kernel, key, time_us: float, stream: int) -> None:
    """One kernel launched (``ExecutionQueue.launch``): a queue item, an ``OpRecord`` or a
    ``FusedKernel``."""
    _launch(_name(key), time_us, stream, _records_of(kernel))


def launched_window(kernels, costs, stream: int, launch_us: float) -> None:
    """The kernels of one flushed window, launched together (``ExecutionQueue.launch_batch``;
    ``costs.each``: ``(key, bytes, time_us, ops)`` per kernel, in order, each without the
    launch overhead ``launch_us`` that the queue adds to each). ``kernels`` is a
    ``WindowLaunches`` command list, its native launch, or a list of queue items. Called before the queue gets
    them: the worker releases a window's records as it runs them."""
    if type(kernels) is list:
        for kernel, (key, _, time_us, _) in zip(kernels, costs.each):
            _launch(_name(key), time_us + launch_us, stream, _records_of(kernel))
        return
    if type(kernels) is _NativeLaunch:  # a window's, in C++: its command list
        kernels = kernels.fallback
    records = kernels.records
    for (members, spec), (key, _, time_us, _) in zip(kernels.launches, costs.each):
        ops = (records[members],) if spec is None else [records[index] for index in members]
        _launch(_name(key), time_us + launch_us, stream, ops)


def host_kernel(key, time_us: float, stream: int) -> None:
    """A launch the host runs itself, inside its aten op (a data-dependent op, a random op
    drawn on the host, a collective: ``ExecutionQueue.account``)."""
    name = _name(key)
    _kernel_launched(name, time_us, stream, [_op_issued(name)], [time_us])


wait_begin = _native.profiler_now_ns


def wait_end(begin_ns: int) -> None:
    """The host waited for the device since ``begin_ns`` (a sync point)."""
    _native.profiler_host_range("neuron::synchronize", begin_ns)
