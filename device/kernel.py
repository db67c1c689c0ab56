"""The IR record of one recorded op, and how it runs as a kernel on the device worker.

Entry point: :class:`OpRecord`, one aten op as the host recorded it. In strict eager a
record is itself one launch (``OpRecord.launch``); the adaptive runtime groups records
into fused kernels (``fusion.kernels``) that run them back to back.

Tensor arguments of a record are *references*: a :class:`DeviceStorage` for a whole
allocation (resolved to its CPU backing tensor when the kernel runs, since the producer may
not have run yet at record time), or a CPU tensor view for views, whose base the host
allocated in order to alias it.
"""
from __future__ import annotations

import torch

from .errors import KernelFailure, describe_call
from .storage import DeviceStorage, ViewRef


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
    if kind is ViewRef:
        return value.resolve(resolve(value.storage, env))
    if kind is list or kind is tuple:
        return kind(resolve(v, env) for v in value)
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
    - ``key``: the op and its argument metadata; ``key_id``: a small number standing for
      it (never reused), the unit of the plan cache's keys;
    - ``location``: the user's line that issued it (raw; ``location.describe`` formats).
    """

    __slots__ = (
        "op", "args", "kwargs", "nested", "reads", "writes", "results", "location", "cost", "key",
        "key_id", "stream", "trace_id",
    )

    def __init__(self, op, args, kwargs, nested, reads, writes, results, location, cost, key, key_id, stream):
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.nested = nested
        self.reads = reads
        self.writes = writes
        self.results = results
        self.location = location
        self.cost = cost
        self.key = key
        self.key_id = key_id
        self.stream = stream
        self.trace_id = 0  # set by the timeline (device/trace.py) while tracing

    @property
    def name(self) -> str:
        return self.op._schema.name

    def run(self, env=None):
        """Run the op on CPU tensors and return its raw result.

        Every storage read here holds data: it was allocated on the host, or written by an
        earlier kernel on the FIFO queue (or that kernel failed, and this one is skipped).
        ``env`` holds the values a fused kernel keeps in registers.
        """
        if not self.nested:
            if env:
                args = [
                    (env.get(a) if a in env else a.data) if type(a) is DeviceStorage else a for a in self.args
                ]
            else:
                args = [a.data if type(a) is DeviceStorage else a for a in self.args]
        else:
            args = resolve(self.args, env)
        kwargs = self.kwargs
        if kwargs:
            return self.op._op(*args, **{k: resolve(v, env) for k, v in kwargs.items()})
        return self.op._op(*args)

    def store(self, result) -> None:
        """Hand each output tensor to its storage (strict eager: no copy when possible)."""
        if isinstance(result, torch.Tensor):
            if self.results[0] is not None:
                self.results[0].adopt(result)
            return
        for storage, value in zip(self.results, flatten_results(result)):
            if storage is not None and value is not None:
                storage.adopt(value)

    def written(self):
        yield from self.writes
        for storage in self.results:
            if storage is not None:
                yield storage

    def failure(self, error: BaseException, kernel_name=None, sequence=0, env=None) -> KernelFailure:
        try:
            call = describe_call(self.name, resolve(self.args, env), {k: resolve(v, env) for k, v in self.kwargs.items()})
        except Exception:  # describing must never hide the real failure
            call = self.name
        return KernelFailure(self.name, call, self.location, kernel_name, error, sequence)

    # -- strict eager: one record is one launch -------------------------------------
    def launch(self, queue) -> None:
        if queue.poison_seen:
            for storage in self.reads:
                if storage.poison is not None:
                    queue.skip(self.written(), storage.poison)
                    return
        try:
            if queue.faults is not None:
                queue.faults.check(self.name)
            result = self.run()
            results = self.results
            if results:
                if isinstance(result, torch.Tensor):
                    if results[0] is not None:
                        results[0].adopt(result)
                else:
                    self.store(result)
        except Exception as error:
            queue.fail(self.failure(error, sequence=queue.completed + 1), self.written())

    def __repr__(self) -> str:
        return f"OpRecord({self.name})"
