"""Simulated device time of a kernel: launch overhead plus a roofline.

Entry points: :class:`DeviceProfile` (the chip's figures), :data:`PROFILE` (the live
one) and :func:`op_cost` (bytes, FLOPs and time of one aten op, from its meta tensors).

    time_us = launch_overhead_us + max(bytes_moved / hbm_bandwidth, flops / peak(dtype))

Bytes are what the kernel reads and writes in device memory: every tensor argument and
every output, ``numel * itemsize`` each (a fused kernel counts only what crosses its
boundary). FLOPs of matmul, conv and attention come from ``torch.utils.flop_counter``'s
formulas; every other op counts one FLOP per element of its largest tensor.

A custom kernel (``device/ops/custom_kernels.py``: an NKI kernel) is timed by its own schedule
instead: :data:`KERNEL_TIMES` gives its device time, and it costs that plus one launch.

The result is deterministic: it depends on shapes and dtypes only, never on the host.
This is what makes the two things fusion saves, launches and memory traffic, visible.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..core.config import CONFIG


@dataclasses.dataclass
class DeviceProfile:
    """One Trainium2 chip, from AWS's published figures.

    ``launch_overhead_us`` is an **assumption**, not a published figure: the fixed cost of
    one kernel launch through the runtime (descriptor set-up, queue doorbell, completion
    semaphore). CUDA's launch latency is about 5 us; the Neuron runtime's per-execution
    overhead is larger, in the tens of microseconds. We take 10 us, between the two, so that
    launch-bound workloads (decode, optimizer steps) look launch-bound, as they do on real
    accelerators. Set ``NEURON_SIM_LAUNCH_US`` to try another value.
    """

    name: str = "trainium2 (one chip, simulated)"
    hbm_bytes: int = 96 * (1 << 30)
    hbm_bandwidth_bytes_per_s: float = 2.9e12
    peak_bf16_flops: float = 667e12  # dense BF16/FP16
    peak_fp32_flops: float = 667e12 / 4
    # On-chip memory of one NeuronCore-v3 (SBUF, 24 MiB): what a fused kernel can keep
    # resident; the adaptive runtime's on-chip fusion rule uses it as its budget.
    sbuf_bytes: int = 24 * (1 << 20)
    # Inter-chip link for collectives: NeuronLink inside a node. An *assumption* for the
    # simulation: 100 GB/s per direction per link (Trn2's NeuronLink-v3 is faster in
    # aggregate; EFA between nodes is slower). Set NEURON_SIM_LINK_GBPS to try another.

    @property
    def launch_overhead_us(self) -> float:
        return CONFIG.launch_us  # read live (NEURON_SIM_LAUNCH_US)

    @property
    def link_bandwidth_bytes_per_s(self) -> float:
        return CONFIG.link_gbps * 1e9  # read live (NEURON_SIM_LINK_GBPS)

    def collective_time_us(self, nbytes: int, world_size: int, all_to_all: bool) -> float:
        """A ring collective: each rank sends and receives (n-1)/n of the data, twice for
        an all-reduce (reduce-scatter, then all-gather)."""
        if world_size <= 1:
            return self.launch_overhead_us
        passes = 2 if all_to_all else 1
        traffic = passes * nbytes * (world_size - 1) / world_size
        return self.launch_overhead_us + traffic / self.link_bandwidth_bytes_per_s * 1e6

    def peak_flops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.peak_bf16_flops
        return self.peak_fp32_flops

    def kernel_time_us(self, nbytes: int, flops: float, dtype: torch.dtype) -> float:
        memory_us = nbytes / self.hbm_bandwidth_bytes_per_s * 1e6
        compute_us = flops / self.peak_flops(dtype) * 1e6
        return self.launch_overhead_us + max(memory_us, compute_us)


PROFILE = DeviceProfile()

# Ops timed by their own kernel's schedule (custom kernels): op -> fn(meta args, meta
# kwargs) -> device microseconds, the launch excluded (``op_cost`` adds one).
KERNEL_TIMES: dict = {}


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _attention_flops(args, kwargs) -> int:
    q, k = args[0], args[1]
    *batch, s_q, d = q.shape
    s_k = k.shape[-2]
    return 4 * math.prod(batch) * s_q * s_k * d


_ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
}


def op_flops(op, args, kwargs, outputs) -> float:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(op.overloadpacket)
    if formula is not None:
        try:
            return float(formula(*args, out_val=outputs, **kwargs))
        except Exception:  # a formula that does not cover this overload
            pass
    if op.name() in _ATTENTION_OPS:
        return float(_attention_flops(args, kwargs))
    largest = 0
    for t in _tensors(list(args) + list(kwargs.values()) + list(outputs)):
        largest = max(largest, t.numel())
    return float(largest)


# In-place ops that overwrite ``self`` without reading it.
_WRITE_ONLY = {
    "aten::fill_", "aten::zero_", "aten::copy_", "aten::normal_", "aten::uniform_",
    "aten::bernoulli_", "aten::random_", "aten::exponential_", "aten::geometric_",
    "aten::log_normal_", "aten::cauchy_",
}


class OpCost:
    """What one op costs the device, from its meta tensors (cached per signature).

    - ``bytes``, ``flops``, ``time_us``: the op as a kernel of its own;
    - ``compute_us``: FLOPs / peak, the compute side of the roofline;
    - ``read_bytes``/``write_bytes``/``result_bytes``: per device tensor read, per tensor
      mutated in place, per fresh output (aligned with the record's ``reads``, ``writes``
      and ``results``), so a fused kernel can count only what crosses its boundary;
    - ``numel``: elements of the first tensor it writes (its iteration space);
      ``input_numel``: elements of its largest input.
    """

    __slots__ = ("bytes", "flops", "time_us", "compute_us", "read_bytes", "write_bytes", "result_bytes", "numel", "input_numel")

    def __init__(self, nbytes, flops, time_us, compute_us, read_bytes, write_bytes, result_bytes, numel, input_numel):
        self.bytes = nbytes
        self.flops = flops
        self.time_us = time_us
        self.compute_us = compute_us
        self.read_bytes = read_bytes
        self.write_bytes = write_bytes
        self.result_bytes = result_bytes
        self.numel = numel
        self.input_numel = input_numel

    def __repr__(self) -> str:
        return f"OpCost(bytes={self.bytes}, flops={self.flops:.0f}, time_us={self.time_us:.3f})"


def op_cost(op, args, kwargs, written, read_bytes=(), write_bytes=(), result_bytes=()) -> OpCost:
    """The cost of one op on meta tensors: every tensor argument is read, every written
    tensor (outputs, and arguments mutated in place) is written."""
    read = list(args) + list(kwargs.values())
    if op._schema.name in _WRITE_ONLY:
        read = read[1:]
    nbytes = sum(tensor_bytes(t) for t in _tensors(read))
    nbytes += sum(tensor_bytes(t) for t in _tensors(written))
    flops = op_flops(op, args, kwargs, written)
    written = list(_tensors(written))
    dtype = written[0].dtype if written else next((t.dtype for t in _tensors(args)), torch.float32)
    inputs = list(_tensors(list(args) + list(kwargs.values())))
    timer = KERNEL_TIMES.get(op)
    if timer is None:
        time_us, compute_us = PROFILE.kernel_time_us(nbytes, flops, dtype), flops / PROFILE.peak_flops(dtype) * 1e6
    else:  # its own schedule, plus one launch
        compute_us = timer(args, kwargs)
        time_us = PROFILE.launch_overhead_us + compute_us
    return OpCost(
        nbytes,
        flops,
        time_us,
        compute_us,
        tuple(read_bytes),
        tuple(write_bytes),
        tuple(result_bytes),
        written[0].numel() if written else 0,
        max((t.numel() for t in inputs), default=0),
    )
