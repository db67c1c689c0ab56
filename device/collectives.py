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
Each collective is counted (``stats()["collectives"]``, and per op with its bytes and
simulated time in ``stats()["distributed"]``) and costed on the simulated queue: launch
overhead plus its ring traffic over the link (``DeviceProfile``).

The communication backend ``neuron`` (:func:`register_backend`, run at device
registration) is the device's default, as ``hccl`` is ``npu``'s: ``init_process_group()``
with no backend, ``init_process_group("neuron")`` and ``init_device_mesh("neuron", ...)``
choose it. It is gloo: the group it makes holds one ``ProcessGroupGloo`` for both the
``neuron`` and the ``cpu`` device types, since the collectives above hand gloo the CPU
tensors over the neuron tensors' bytes (and object collectives, ``gather_object`` for
``torch.distributed.checkpoint``, run on CPU tensors).
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

# An all-reduce crosses the ring twice (reduce-scatter, then all-gather); every other
# collective once.
_TWO_PASSES = ("allreduce", "all_reduce")
BACKEND_NAME = "neuron"
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


def _payload_bytes(args, kwargs) -> int:
    """The bytes a collective moves: the larger of its inputs and its outputs, so an
    all-gather counts the gathered tensor (not it plus the input), a reduce-scatter the
    tensor it reduces, an all-reduce its tensor once. The first tensor argument (or list
    of them) is the output or the in-place buffer in every c10d op; the rest are inputs."""
    groups = [list(_device_tensors([value])) for value in list(args) + list(kwargs.values())]
    sizes = [sum(t.numel() * t.element_size() for t in group) for group in groups if group]
    if not sizes:
        return 0
    return max(sizes[0], sum(sizes[1:]))


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
    nbytes = _payload_bytes(args, kwargs)
    short = name.split("::")[-1]
    time_us = PROFILE.collective_time_us(nbytes, _world_size(host_args), short.startswith(_TWO_PASSES))
    calls, total_bytes, total_us = COUNTERS.collective_totals.get(name, (0, 0, 0.0))
    COUNTERS.collective_totals[name] = (calls + 1, total_bytes + nbytes, total_us + time_us)
    QUEUE.account(entry.op, nbytes, time_us, _STREAMS.current)
    # mutated inputs come back as the caller's tensors; fresh outputs (functional
    # collectives) become device tensors over the CPU result
    return upload_result(entry, result, args, kwargs)


def _create_process_group(options, pg_options=None):
    """The ``neuron`` backend's constructor (``Backend.register_backend``, extended API):
    a process group whose ``neuron`` and ``cpu`` device types are one gloo backend.

    It returns a whole ``ProcessGroup`` rather than a ``Backend`` because, with no backend
    named, torch.distributed asks the accelerator's default backend for the accelerator's
    device type alone; the collectives on neuron tensors run gloo on CPU tensors, which
    need the group to answer for ``cpu`` too."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    if pg_options is not None and not isinstance(pg_options, ProcessGroupGloo._Options):
        raise TypeError(f"the neuron backend is gloo: pg_options must be ProcessGroupGloo.Options, not {type(pg_options).__name__}")
    group = ProcessGroup(options.store, options.group_rank, options.group_size)
    gloo = ProcessGroupGloo(options.store, options.group_rank, options.group_size, timeout=options.timeout)
    gloo.options.global_ranks_in_group = options.global_ranks_in_group
    gloo.options.group_name = options.group_id
    gloo._set_sequence_number_for_group()
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    for device in ("neuron", "cpu"):
        group._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO, gloo)
    return group


def register_backend() -> None:
    """Register ``neuron`` with torch.distributed as the neuron device's default backend
    (``Backend.default_device_backend_map``). ``import torch`` has imported
    torch.distributed already (torch/__init__ does), so this costs a dictionary update."""
    if not torch.distributed.is_available():
        return
    from torch.distributed import Backend

    if BACKEND_NAME in Backend.backend_list:
        return
    Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=["neuron", "cpu"])
