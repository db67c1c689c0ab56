"""``torch.distributed`` collectives on neuron tensors, through gloo on the CPU bytes.

Entry point: :func:`run_collective`, which the dispatcher calls for every ``c10d::`` op
(``all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``, ``barrier``,
``send``/``recv``...). No communication layer of our own: the op itself runs, on the CPU
tensors that hold the neuron tensors' bytes, so gloo (or any backend registered for the
CPU) moves the data.

A collective is a sync point: the adaptive window is flushed and the queue drained first,
so the collective reads what every earlier kernel wrote. It then completes before the
call returns (its work is waited for), so later kernels, queued in order, read its result;
an ``async_op=True`` handle's ``wait()`` then returns at once, with the result visible.
Point-to-point ops (``send``, ``recv``) are the exception: their work is the caller's to
wait for, once (see ``_POINT_TO_POINT``).
Each collective is counted (``stats()["collectives"]``) and costed on the simulated queue:
launch overhead plus its ring traffic over the link (``DeviceProfile``).
"""
from __future__ import annotations

import torch

from . import sync as _sync
from .cost_model import PROFILE
from .host_ops import host_call_args, upload_result
from .metrics import COUNTERS
from .queue import QUEUE
from .streams import STATE as _STREAMS
from .tensor import describe

_ALL_TO_ALL = ("allreduce", "reduce_scatter", "all_reduce")
# Point-to-point ops return their work unwaited: gloo's send/recv work completes once, so
# a second wait (the caller's, after ours) would block until the timeout. The caller
# waits before touching the buffer, which is the contract of send/recv on any device
# (dist.send/recv wait at once; isend/irecv users call wait()).
_POINT_TO_POINT = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")


def _device_tensors(values):
    for value in values:
        if describe(value) is not None:
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _device_tensors(value)


def _world_size(args) -> int:
    for value in args:
        if isinstance(value, torch._C.ScriptObject) and hasattr(value, "size"):
            try:
                return int(value.size())
            except Exception:  # not a process group after all
                continue
    return 1


def run_collective(entry, args, kwargs):
    _sync.synchronize(f"collective: {entry.name}")
    host_args, host_kwargs = host_call_args(entry, args, kwargs, check_poison=True)
    result = entry.op(*host_args, **host_kwargs)
    name = entry.name
    if name not in _POINT_TO_POINT:
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for value in outputs:
            if isinstance(value, torch._C.ScriptObject) and hasattr(value, "wait"):
                value.wait()  # done before any later kernel can read the result
    COUNTERS.collectives[name] += 1
    tensors = list(_device_tensors(list(args) + list(kwargs.values())))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    short = name.split("::")[-1]
    time_us = PROFILE.collective_time_us(nbytes, _world_size(host_args), short.startswith(_ALL_TO_ALL))
    QUEUE.account(entry.op, nbytes, time_us, _STREAMS.current)
    # mutated inputs come back as the caller's tensors; fresh outputs (functional
    # collectives) become device tensors over the CPU result
    return upload_result(entry, result, args, kwargs)
