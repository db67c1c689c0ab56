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

Before it runs, the ranks check that they agree on it (:func:`_check_agreement`): the same
op and, for the ops whose tensors must match on every rank (all-reduce, broadcast,
all-gather, reduce-scatter), the same shapes and dtypes. gloo itself does not: an
all-reduce of 4 elements on one rank and 3 on the other silently returns wrong numbers on
one and a lost connection on the other. The check is one 8-byte all-gather of a digest
over the same group; on a mismatch every rank raises an error that names the op and what
each rank passed.
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

from ..core.counters import COUNTERS
from ..core.errors import users_error
from ..core.reasons import Flush
from ..hardware import sink
from ..hardware.cost_model import PROFILE
from ..hardware.execution_queue import QUEUE
from ..hardware.streams import STATE as _STREAMS
from ..memory.tensor import describe
from .host_ops import host_call_args, upload_result

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


def _group(args):
    """The process group among a c10d op's arguments, as the Python ``ProcessGroup``
    (the op holds it boxed, a TorchBind object with no Python methods)."""
    for value in args:
        if isinstance(value, torch._C.ScriptObject) and value._type().qualified_name().endswith("c10d.ProcessGroup"):
            return torch.distributed.ProcessGroup.unbox(value)
    return None


def _world_size(args) -> int:
    group = _group(args)
    return int(group.size()) if group is not None else 1


# The ops whose tensor arguments have the same shapes and dtypes on every rank; for the
# others (scatter, gather, all-to-all with splits) only the op must agree.
_SYMMETRIC = {f"c10d::{name}" for name in (
    "allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_", "_allgather_base_",
    "allgather_into_tensor_coalesced_", "allgather_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "barrier")}
_DESCRIPTION_BYTES = 2048


def _signature(name, args, kwargs) -> str:
    if name not in _SYMMETRIC:
        return name
    parts = []
    for value in list(args) + list(kwargs.values()):
        tensors = list(_device_tensors([value]))
        if tensors:
            parts.append(", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in tensors))
    return f"{name}({'; '.join(parts)})"


def _all_gather_cpu(group, tensor, size):
    out = torch.empty((size,) + tuple(tensor.shape), dtype=tensor.dtype)
    _, work = torch.ops.c10d._allgather_base_(out.view(-1), tensor.reshape(-1), group.boxed(), False, -1)
    work.wait()
    return out


def _check_agreement(name, args, kwargs, host_args) -> None:
    """Every rank of the group runs the same collective on matching tensors, or every rank
    raises (see the module's docstring)."""
    import hashlib

    if name in _POINT_TO_POINT:
        return
    group = _group(host_args)
    size = int(group.size()) if group is not None else 1
    if size <= 1:
        return
    signature = _signature(name, args, kwargs)
    digest = int.from_bytes(hashlib.blake2b(signature.encode(), digest_size=8).digest(), "little", signed=True)
    digests = _all_gather_cpu(group, torch.tensor([digest], dtype=torch.int64), size)
    if bool((digests == digests[0]).all()):
        return
    # every rank saw the mismatch: exchange the signatures to say what each rank ran
    encoded = signature.encode()[:_DESCRIPTION_BYTES]
    mine = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
    mine[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    everyone = _all_gather_cpu(group, mine, size)
    said = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in everyone]
    lines = "\n".join(f"  rank {rank} of the group: {text}" for rank, text in enumerate(said))
    raise users_error(RuntimeError(
        f"{name}: the ranks of the process group disagree on this collective "
        f"(a different op, or tensors of other shapes or dtypes); nothing was exchanged:\n{lines}"))


def run_collective(entry, args, kwargs):
    sink.synchronize(Flush.COLLECTIVE.of(entry.name))
    host_args, host_kwargs = host_call_args(entry, args, kwargs, check_poison=True)
    _check_agreement(entry.name, args, kwargs, host_args)
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
    transfer_us = PROFILE.collective_transfer_us(nbytes, _world_size(host_args), short.startswith(_TWO_PASSES))
    calls, total_bytes, total_us = COUNTERS.collective_totals.get(name, (0, 0, 0.0))
    COUNTERS.collective_totals[name] = (calls + 1, total_bytes + nbytes,
                                        total_us + transfer_us + PROFILE.launch_overhead_us)
    QUEUE.account(entry.op, nbytes, transfer_us, _STREAMS.current)  # (the queue adds the launch)
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
