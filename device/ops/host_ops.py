"""Ops run on the host bytes after a sync point: host reads, copies to the host,
data-dependent ops, random ops that draw on the host, and the CPU fallback.

Entry points: :func:`run_on_host`, :func:`host_call_args` (a call's arguments with neuron
tensors replaced by the CPU tensors holding their bytes) and :func:`upload_result` (a
host result as device tensors).
"""
from __future__ import annotations

import torch

from ..core.config import CONFIG
from ..core.counters import COUNTERS
from ..core.errors import poisoned_read_error, quantized_refusal, users_error
from ..core.reasons import Flush
from ..hardware import sink
from ..hardware.cost_model import PROFILE, op_cost
from ..hardware.execution_queue import QUEUE
from ..hardware.streams import STATE as _STREAMS
from ..memory.storage import DeviceStorage, storage_nbytes
from ..memory.tensor import cpu_view, describe, device_tensor, storage_of
from .rng import GENERATOR, device_generator_as_default, generator_twin
from .views import set_metadata

aten = torch.ops.aten
CPU = torch.device("cpu")
_Tensor = torch.Tensor


def host_call_args(entry, args, kwargs, check_poison=False):
    """Arguments with neuron tensors replaced by the CPU tensors over their bytes."""

    def convert(value):
        described = describe(value)
        if described is not None:
            if check_poison:
                storage = described[1] if described[1] is not None else storage_of(value)
                if storage.poison is not None:
                    raise poisoned_read_error(storage.poison)
            return cpu_view(value)
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        if isinstance(value, torch.device) and value.type == "neuron":
            return CPU
        if isinstance(value, torch.Generator) and value.device.type == "neuron":
            return generator_twin(value)
        return value

    host_args = [convert(a) for a in args]
    host_kwargs = {k: convert(v) for k, v in kwargs.items()}
    if entry.generator_arg is not None and host_kwargs.get("generator") is None:
        host_kwargs["generator"] = GENERATOR
    return host_args, host_kwargs


def _histc_any_dtype(input, bins=100, min=0, max=0):
    """CUDA's histc takes integer tensors (the CPU kernel does not): counts in the input's
    dtype. Hugging Face's MoE routing relies on it on every accelerator."""
    if input.is_floating_point():
        return aten.histc.default(input, bins, min, max)
    return aten.histc.default(input.double(), bins, min, max).to(input.dtype)


# Ops whose accelerator semantics the CPU kernel lacks: the device implements them so.
_ACCELERATOR_SEMANTICS = {aten.histc.default: _histc_any_dtype}


def run_on_host(entry, args, kwargs, reason):
    """Run an op on the CPU backing tensors after a sync point.

    Reasons: ``host_read`` (the result is a host value), ``copy_to_host``,
    ``data_dependent`` (output shape unknown until it runs), ``fallback`` (no meta kernel:
    the device cannot queue it), ``meta_rejected`` (the meta kernel raised; the CPU
    decides whether this is the user's error or a meta kernel's), ``memory_overlap`` (the
    CPU refuses the arguments' aliasing, ``overlap.py``) and ``random_on_host``
    (a random op that must draw in program order on the host, ``device/ops/rng.py``).
    """
    if reason is Flush.FALLBACK and not CONFIG.fallback:
        raise users_error(NotImplementedError(
            f"{entry.name} is not supported on the neuron device (no meta kernel to infer its "
            "output), and NEURON_FALLBACK=0 forbids running it on the CPU."
        ))
    sink.synchronize(reason.of(entry.name) if reason in (Flush.FALLBACK, Flush.DATA_DEPENDENT) else reason)
    host_args, host_kwargs = host_call_args(entry, args, kwargs, check_poison=True)
    try:
        if entry.host_random:
            with device_generator_as_default():
                result = entry.op(*host_args, **host_kwargs)
        else:
            result = _ACCELERATOR_SEMANTICS.get(entry.op, entry.op)(*host_args, **host_kwargs)
    except Exception as error:  # the CPU's verdict on the user's arguments (a shape error...)
        raise users_error(error)
    if reason in (Flush.FALLBACK, Flush.META_REJECTED, Flush.MEMORY_OVERLAP):
        COUNTERS.fallback_ops[entry.name] += 1
    elif reason in (Flush.DATA_DEPENDENT, Flush.RANDOM_ON_HOST):
        # One blocking launch: counted and costed like any kernel, from its real sizes.
        COUNTERS.ops_recorded += 1
        written = [t for t in (result if isinstance(result, (list, tuple)) else (result,)) if isinstance(t, _Tensor)]
        cost = op_cost(entry.op, host_args, host_kwargs, written)
        start = QUEUE.account(entry.op, cost.bytes, cost.time_us, _STREAMS.current)
        trace = QUEUE.trace_recorder
        if trace is not None:
            trace.kernel(entry.op, entry.op, start, cost.time_us + PROFILE.launch_overhead_us, _STREAMS.current, 0)
    if reason in (Flush.HOST_READ, Flush.COPY_TO_HOST):
        return result
    return upload_result(entry, result, args, kwargs)


def run_random_on_host_with_device_generator(entry, args, kwargs):
    """A random op on host tensors that names a neuron generator (``torch.randn(shape,
    generator=torch.Generator("neuron"), device="cpu")``, which Diffusers' ``randn_tensor``
    issues for a neuron pipeline): it draws from that generator's stream, on the host, in
    program order, after a sync point (the worker may be drawing from it), and its result
    stays on the host. The mirror of a CPU generator passed to a neuron op (rng.py).
    Anything else that mixes devices is the user's error."""
    def leaves(value):
        if isinstance(value, (list, tuple)):
            for v in value:
                yield from leaves(v)
        else:
            yield value

    for value in leaves([*args, *kwargs.values()]):
        device = value.device if isinstance(value, (_Tensor, torch.device)) else None
        if device is not None and device.type == "neuron":
            raise users_error(RuntimeError(
                f"{entry.name}: a neuron generator with tensors on more than one device"))
    sink.synchronize(Flush.RANDOM_ON_HOST)
    host_kwargs = dict(kwargs, generator=generator_twin(kwargs["generator"]))
    try:
        return entry.op(*args, **host_kwargs)
    except Exception as error:
        raise users_error(error)


def upload_result(entry, result, args, kwargs):
    """Fresh CPU results of a host-run op become device tensors; mutated inputs are
    already updated in place (their CPU tensors alias device memory)."""
    if isinstance(result, _Tensor):
        return _upload_one(entry, result, args, kwargs, 0)
    if isinstance(result, (list, tuple)):
        return type(result)(
            _upload_one(entry, value, args, kwargs, i) if isinstance(value, _Tensor) else value
            for i, value in enumerate(result)
        )
    return result


def _upload_one(entry, value, args, kwargs, position):
    aliases = entry.return_alias
    alias = aliases[position] if position < len(aliases) else None
    if alias is not None:
        index, name = alias
        target = args[index] if index < len(args) else kwargs[name]
        if value.shape != target.shape or value.stride() != target.stride():
            # The CPU kernel resized ``out`` to a size only the data decides (masked_select,
            # nonzero): the device tensor takes the result's metadata and its values, over a
            # fresh storage as ATen's resize gives a grown one.
            fresh = _upload_one(entry, value, (), {}, len(aliases))
            set_metadata(target, fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
        return target
    if value.layout == torch.sparse_coo:
        return _upload_sparse(entry, value)
    if value.is_quantized:
        raise users_error(quantized_refusal(entry.name))
    if value.layout != torch.strided:
        raise users_error(NotImplementedError(f"{entry.name} returned a {value.layout} tensor; sparse layouts are not supported on the neuron device"))
    value = value.clone() if value._is_view() or value.storage_offset() else value
    shape, stride = tuple(value.shape), tuple(value.stride())
    nbytes = storage_nbytes(shape, stride, value.element_size())
    return device_tensor(shape, stride, value.dtype, DeviceStorage(shape, stride, value.dtype, nbytes, value), nbytes)


def _upload_sparse(entry, value):
    """A CPU sparse COO result as a sparse neuron tensor of uploaded indices and values
    (``device/ops/sparse.py``), with the result's coalesced flag."""
    fresh = len(entry.return_alias)  # a position past the returns: never an alias
    indices = _upload_one(entry, value._indices(), (), {}, fresh)
    values = _upload_one(entry, value._values(), (), {}, fresh)
    return aten._sparse_coo_tensor_with_dims_and_tensors.default(
        value.sparse_dim(), value.dense_dim(), value.shape, indices, values, dtype=value.dtype,
        layout=torch.sparse_coo, device=indices.device, is_coalesced=value.is_coalesced())
