"""Simulated device time of a kernel: one logical NeuronCore of Trainium2, engine by engine.

Entry points: :class:`DeviceProfile` (the figures of one logical NeuronCore, LNC=2 or 1),
:data:`PROFILE` (the live one, ``NEURON_SIM_LNC``), :func:`op_cost` (bytes, FLOPs, engine
times and time of one aten op, from its meta tensors), and the engine model that costs NKI
ISA instructions too: :meth:`DeviceProfile.instruction_cycles`,
:meth:`DeviceProfile.engine_time_us`, :meth:`DeviceProfile.nc_matmul_cycles`,
:meth:`DeviceProfile.dma_time_us`.

A kernel's time is the busiest of its engines and of its DMA traffic, which run in
parallel (each engine has its own instruction stream, and DMA queues of their own)::

    time_us = max(dma_us(bytes), tensor_us, vector_us, scalar_us, gpsimd_us)

and the execution queue adds the launch overhead (``NEURON_SIM_LAUNCH_US``, read live)
when it accounts for the launch (``execution_queue.ExecutionQueue._account``): a cost
cached at shape inference (``OpCost.time_us``, ``KernelSpec.time_us``) never holds it.

- **TensorE**: matmuls (mm, addmm, bmm, baddbmm, mv, dot: tiled as NKI's ``nc_matmul``,
  128 x 128 stationary tiles, moving tiles of at most 512 columns; convolution and
  attention at the array's peak from their FLOPs);
- **ScalarE**: transcendental activations (exp, tanh, GELU, SiLU, sqrt ...), the exp of
  softmax and attention;
- **VectorE**: every other elementwise op, the reductions and normalizations, fills: it
  streams the elements it reads (two inputs: twice the elements, as ``tensor_tensor``);
- **GpSimdE**: the rest (index, gather, scatter, sort, cumsum, iota, triu, random draws);
- **DMA**: the bytes the kernel reads and writes in device memory (HBM) through the core's
  DMA engines. Copies, casts and concatenations are DMA only.

Bytes are every tensor argument and every output, ``numel * itemsize`` each (a fused
kernel counts only what crosses its boundary). FLOPs of matmul, conv and attention come
from ``torch.utils.flop_counter``'s formulas; every other op counts one FLOP per element
of its largest tensor (FLOPs are reported, not used for time). The result is
deterministic: it depends on shapes and dtypes only, never on the host.

Sources. Every figure cites the public ``aws-neuron/aws-neuron-sdk`` repository (the
Neuron documentation's sources) at commit ``81ce03ae261e12925e53437a0f690478e6366155``
(2026-08-21) unless said otherwise; per-instruction costs cite commit
``1db4d74ec718b8c3287ad118ad021c95c64ff455`` (2025-10-17, the last with the "Estimated
instruction cost" sections of ``nki/api/nki/isa/__init__.py``; the same text is in Neuron
2.26.0). Paths are relative to that repository. Where two pages disagree, the choice
and its reason are written next to the figure. Everything marked **assumption** is not
published.

A custom kernel (``device/ops/custom_kernels.py``: an NKI kernel) is timed by its own
schedule instead: :data:`KERNEL_TIMES` gives its device time (the NKI simulator's schedule
of its instructions on these engines, ``device/nki/cost.py``), and the queue adds the launch.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..core.config import CONFIG

# -- engines --------------------------------------------------------------------------------
TENSOR, VECTOR, SCALAR, GPSIMD = "tensor", "vector", "scalar", "gpsimd"
ENGINES = (TENSOR, VECTOR, SCALAR, GPSIMD)  # the order of ``OpCost.engine_us``
_INDEX = {engine: i for i, engine in enumerate(ENGINES)}

# Engine clocks of NeuronCore-v3 ("Compute Engine Specifications" table,
# nki/guides/architecture/trainium2_arch.rst L41-64): Tensor 2.4, Vector 0.96,
# Scalar 1.2, GpSimd 1.2 GHz.
CLOCK_HZ = {TENSOR: 2.4e9, VECTOR: 0.96e9, SCALAR: 1.2e9, GPSIMD: 1.2e9}

# Partitions (lanes) of SBUF and of the Vector, Scalar and GpSimd engines; rows and
# columns of TensorE's systolic array: 128 ("pmax", nki/get-started/about/tiling-overview.rst
# L96; "a systolic array with 128 rows and 128 columns of processing elements",
# nki/api/nki/isa/__init__.py L514). An instruction costs the same on fewer lanes
# (nki/guides/architecture/trainium_inferentia2_arch.rst L380).
PMAX = 128
# nc_matmul's moving tile has at most 512 columns on NeuronCore-v3, one FP32 PSUM bank
# (nki/api/nki/isa/__init__.py L612-615).
MOVING_FMAX = 512

# Per-instruction overheads, in engine cycles. Published for NeuronCore-v2 or with no
# generation; **assumption**: the same cycle counts hold on NeuronCore-v3 (no v3 value is
# published).
# - MIN_II: "the minimum instruction initiation interval for small input tiles. MIN_II is
#   roughly 64 engine cycles" (SDK @1db4d74e nki/api/nki/isa/__init__.py, each
#   instruction's "Estimated instruction cost"); also TensorE's MM_INIT_LATENCY, 64 cycles
#   (nki/guides/architecture/trainium_inferentia2_arch.rst L265-270).
MIN_II_CYCLES = 64
# - GpSimdE's instruction start-up: "GPSIMD_START is the instruction startup overhead on
#   GpSimdE, roughly 150 engine cycles" (SDK @1db4d74e nki/api/nki/isa/__init__.py
#   L289-292); iota costs "150 + N" (L565-567).
GPSIMD_START_CYCLES = 150


def _is_16bit_float(dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def _is_fp8(dtype) -> bool:
    return "float8" in str(dtype)


def lane_rate(engine: str, dtype) -> float:
    """Elements one lane (partition) of ``engine`` streams per cycle in ``dtype``; for
    TensorE, moving-tile columns per cycle.

    - TensorE: one moving column per cycle for BF16/FP16/TF32 (nc_matmul costs
      ``max(min(64, N_stationary), N_moving)`` cycles, SDK @1db4d74e
      nki/api/nki/isa/__init__.py L897-916); FP32 costs 4x ("FP32 uses 4.0x",
      tools/neuron-explorer/profile-schema-reference.rst L2126), FP8 0.5x on Trn2 (same
      line; "double the throughput compared to BF16/FP16",
      nki/guides/architecture/trainium2_arch.rst L76). Other dtypes (integers) as FP32:
      an assumption. At 2.4 GHz this gives 2 x 128 x 128 x 2.4e9 = 78.6 TFLOPS BF16 and
      19.7 FP32 per physical core, the published "79 BF16/FP16/TF32 and 20 FP32 dense
      TFLOPS" (trainium2_arch.rst L71) to rounding.
    - VectorE: "512 BF16/FP16 input/output; 256 input/output for other data types" per
      cycle (trainium2_arch.rst, the engine table): 4 or 2 elements per lane. An
      instruction streams the elements it reads (one input: N, two: 2N, as the published
      ``max(MIN_II, N)`` / ``max(MIN_II, 2N)`` costs of NeuronCore-v2's 128-wide engine).
      Chosen over NeuronCore-v2's 1 element per lane, which the ISA cost formulas were
      written for: the v3 table is the only NeuronCore-v3 figure (its 4x BF16 mode is
      automatic, trainium2_arch.rst L222-240).
    - ScalarE: "128 input/output" per cycle (same table): 1 element per lane, any dtype
      (``activation`` costs ``max(MIN_II, N)``, SDK @1db4d74e isa/__init__.py L166-172).
    - GpSimdE: "eight fully-programmable 512-bit wide vector processors"
      (about-neuron/arch/neuron-hardware/neuron-core-v3.rst L55), "16x FP32 ... 32x FP16
      ... 64x INT8" lanes each (trainium_inferentia2_arch.rst L524-526): 8 x 512 bits per
      cycle over 128 partitions, i.e. ``4 / itemsize`` elements per lane (1 for FP32, as
      iota's ``150 + N``).
    """
    if engine == TENSOR:
        if _is_fp8(dtype):
            return 2.0
        if _is_16bit_float(dtype):
            return 1.0
        return 0.25
    if engine == VECTOR:
        return 4.0 if _is_16bit_float(dtype) else 2.0
    if engine == SCALAR:
        return 1.0
    if engine == GPSIMD:
        return 4.0 / (dtype.itemsize if isinstance(dtype, torch.dtype) else 4)
    raise ValueError(f"unknown engine {engine!r}; the engines are {', '.join(ENGINES)}")


# -- the chip and its logical cores ------------------------------------------------------------
# Trainium2 chip (about-neuron/arch/neuron-hardware/trainium2.rst):
PHYSICAL_CORES_PER_CHIP = 8  # "Every Trainium2 chip contains eight NeuronCore-V3 cores." (L7)
CHIP_HBM_BYTES = 96 * (1 << 30)  # "96 GiB of device memory with 2.9 TB/sec of bandwidth." (L30)
# HBM bandwidth per chip: 2.9 TB/s (trainium2.rst L30; trn2-arch.rst: 46.4 TB/s per 16-chip
# instance = 2.9). The NKI guide says 3 TB/s since 2026 (nki/guides/architecture/
# trainium2_arch.rst L16; it said 2.9 before): we take 2.9, which the architecture page,
# the instance table and the DMA figures below (16 x 23 B/ns = 368 GB/s per core, about
# 2.9 TB/s / 8) agree on.
CHIP_HBM_BANDWIDTH = 2.9e12
# "Trainium2 devices contain four 24GB HBM banks. Each bank is shared by two physical
# NeuronCore-v3." (about-neuron/arch/neuron-features/logical-neuroncore-config.rst L65)
HBM_STACKS_PER_CHIP = 4
# DMA: "Each NeuronCore (v2-v4) is paired with 16 DMA engines."
# (nki/get-started/about/nki-dma-overview.rst L7); peak "Trainium2 - 23 B/ns - 16 -
# 368 GB/s" (same file L46-63, the per-generation table; nki/deep-dives/
# nki-dma-bandwidth-guide.rst L57-63). The same page's prose gives 27.2 GB/s per engine
# (L16): we take the table's 23 B/ns, which a measured single-engine transfer matches
# (32 KiB in 1416 ns = 23.1 B/ns, same file L148-153).
DMA_ENGINES_PER_CORE = 16
DMA_ENGINE_BYTES_PER_S = 23e9
# The fixed cost of one DMA transfer: "descriptor setup, synchronization, and
# semaphore-to-start latency (~1300 ns cross-engine)" (nki/deep-dives/
# nki-dma-bandwidth-guide.rst L39-41). Not in an op's cost (the launch overhead stands
# for the fixed costs); for an NKI ``dma_copy``: ``dma_time_us(nbytes, transfers=1)``.
DMA_FIXED_US = 1.3
# On-chip memory per physical NeuronCore-v3: "SBUF capacity is 28MiB (or, 128 partitions
# of 224KiB) ... PSUM capacity remains the same at 2MiB." (trainium2_arch.rst L39)
SBUF_BYTES_PER_CORE = 28 * (1 << 20)
PSUM_BYTES_PER_CORE = 2 * (1 << 20)

# The launch overhead (NEURON_SIM_LAUNCH_US, default 10 us) is an **assumption**: no
# runtime per-execution or TorchNeuron per-op launch figure is published. The published
# figures around it:
# - below: ~100 engine cycles of static overhead per instruction ("a static instruction
#   overhead of 100 engine cycles", trainium_inferentia2_arch.rst L401-404; ~0.1 us on
#   VectorE), ~600 ns per hardware-DGE DMA instruction (trainium2_arch.rst L364), ~1.3 us
#   from semaphore to DMA start (DMA_FIXED_US above): what one kernel costs at least;
# - above: 437 us of idle device between NEFF executions in vllm-neuron's synchronous
#   mode, "dispatch overheads, tensor allocations, and Python overheads" included, and
#   none in its asynchronous mode (vllm-neuron/docs/design/framework/async_execution.md
#   L157-159); ~1 ms GpSimd warm-up on a NEFF's first execution (a maintainer, issue
#   aws-neuron/aws-neuron-sdk#994).
# 10 us sits between: several DMA set-ups and a semaphore round trip, well under a
# synchronous Python dispatch.


@dataclasses.dataclass
class DeviceProfile:
    """One logical NeuronCore of Trainium2: ``lnc`` physical NeuronCore-v3 (2 by default,
    TorchNeuron's; 1 with ``NEURON_SIM_LNC=1``). One ``neuron`` device is one logical
    core, as on TorchNeuron ("With LNC=2 (default), these are grouped into 4 Logical
    NeuronCores. With LNC=1, all 8 physical cores are treated as individual logical
    NeuronCores", logical-neuroncore-config.rst L14).

    Its compute is its physical cores' engines together. **Assumption**: a kernel's work
    splits evenly over them (an NKI kernel on LNC=2 runs on both, ``program_id`` 0 and 1,
    nki/get-started/about/lnc.rst L19-21); an NKI instruction runs on one (``cores=1``).

    Its memory is its share of the chip's HBM. With LNC=2 the two physical cores are the
    two that share one of the chip's four HBM stacks (their partner is "the NeuronCores
    that share the same HBM stack", nki/api/nki/isa/__init__.py L2990): one stack's
    capacity, 24 GiB, and **assumption** one quarter of the chip's 2.9 TB/s (per-stack
    bandwidth is not published; an even split over the stacks). With LNC=1 a core shares
    its stack with its neighbour ("both physical NeuronCores have access to the entire 24GB
    HBM bank", logical-neuroncore-config.rst L101): **assumption** half of it each, as
    when every core of the chip runs (TorchNeuron's one process per core); with its
    neighbour idle a core is bounded by its DMA engines, 368 GB/s, barely more than the
    362.5 GB/s of the even split. DMA bandwidth is the lower of the core's DMA engines'
    and its HBM share.
    """

    lnc: int = 2

    def __post_init__(self) -> None:
        if self.lnc not in (1, 2):
            raise ValueError(f"lnc must be 1 or 2, not {self.lnc!r}")

    # -- figures ---------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"Trainium2 logical NeuronCore (LNC={self.lnc}: {self.lnc} x NeuronCore-v3), simulated"

    @property
    def physical_cores(self) -> int:
        return self.lnc

    @property
    def logical_cores_per_chip(self) -> int:
        return PHYSICAL_CORES_PER_CHIP // self.lnc

    @property
    def hbm_bytes(self) -> int:
        """The logical core's share of the chip's 96 GiB: 24 GiB (LNC=2), 12 GiB (LNC=1)."""
        return CHIP_HBM_BYTES // self.logical_cores_per_chip

    @property
    def hbm_bandwidth_bytes_per_s(self) -> float:
        """The logical core's share of the chip's HBM bandwidth (class docstring)."""
        return CHIP_HBM_BANDWIDTH / self.logical_cores_per_chip

    @property
    def dma_engines(self) -> int:
        return DMA_ENGINES_PER_CORE * self.lnc

    @property
    def dma_bytes_per_s(self) -> float:
        """What the kernel's DMA traffic moves at: the lower of the DMA engines' peak and
        the HBM share (725 GB/s at LNC=2, 362.5 GB/s at LNC=1)."""
        return min(self.dma_engines * DMA_ENGINE_BYTES_PER_S, self.hbm_bandwidth_bytes_per_s)

    @property
    def sbuf_bytes(self) -> int:
        """SBUF of the logical core: 28 MiB per physical core, one per core (the two SBUFs of
        LNC=2 are separate: each core runs its own copy of a kernel)."""
        return SBUF_BYTES_PER_CORE * self.lnc

    @property
    def psum_bytes(self) -> int:
        return PSUM_BYTES_PER_CORE * self.lnc

    @property
    def total_memory(self) -> int:
        """The simulated device memory (``NEURON_SIM_HBM_GB``, by default :attr:`hbm_bytes`):
        ``torch.neuron.get_device_properties().total_memory``, as CUDA's."""
        return CONFIG.hbm_bytes

    @property
    def launch_overhead_us(self) -> float:
        return CONFIG.launch_us  # read live (NEURON_SIM_LAUNCH_US): an assumption (above)

    @property
    def link_bandwidth_bytes_per_s(self) -> float:
        # Inter-chip link for collectives, an **assumption** (NEURON_SIM_LINK_GBPS, read
        # live): 100 GB/s per direction. Trn2's NeuronLink-v3 is faster in aggregate
        # (1.28 TB/s per chip, trainium2.rst L36-37); EFA between nodes is slower.
        return CONFIG.link_gbps * 1e9

    def peak_flops(self, dtype) -> float:
        """TensorE's dense peak of the logical core in ``dtype``: 2 x 128 x 128 x 2.4 GHz x
        ``lane_rate`` per physical core (157.3 TFLOPS BF16 and 39.3 FP32 at LNC=2)."""
        return 2 * PMAX * PMAX * CLOCK_HZ[TENSOR] * lane_rate(TENSOR, dtype) * self.lnc

    @property
    def peak_bf16_flops(self) -> float:
        return self.peak_flops(torch.bfloat16)

    @property
    def peak_fp32_flops(self) -> float:
        return self.peak_flops(torch.float32)

    # -- the engine model (ops and NKI instructions) -----------------------------------
    @staticmethod
    def instruction_cycles(engine: str, free_elements: float, dtype) -> float:
        """Cycles of one instruction on one physical core whose lanes each stream
        ``free_elements`` elements (the free size of its tiles, times the inputs it reads):
        ``max(MIN_II, N / rate)``, and ``150 + N / rate`` on GpSimdE (module constants).
        For TensorE ``free_elements`` are moving columns; :meth:`nc_matmul_cycles` gives
        ``nc_matmul``'s published cost exactly."""
        cycles = free_elements / lane_rate(engine, dtype)
        if engine == GPSIMD:
            return GPSIMD_START_CYCLES + cycles
        return cycles if cycles > MIN_II_CYCLES else MIN_II_CYCLES

    def instruction_time_us(self, engine: str, free_elements: float, dtype) -> float:
        return self.instruction_cycles(engine, free_elements, dtype) / CLOCK_HZ[engine] * 1e6

    def engine_time_us(self, engine: str, elements: float, dtype, partitions: int = PMAX, cores: int | None = None) -> float:
        """Time for ``engine`` to stream ``elements`` elements spread over ``partitions``
        lanes and ``cores`` physical cores (default: all of the logical core's), as one
        instruction per core: ``instruction_time_us`` of ``elements / (partitions x
        cores)`` per lane. Nothing to do costs nothing."""
        if elements <= 0:
            return 0.0
        per_lane = elements / (min(partitions, PMAX) * (self.lnc if cores is None else cores))
        return self.instruction_time_us(engine, per_lane, dtype)

    @staticmethod
    def nc_matmul_cycles(stationary_free: int, moving_free: int, dtype) -> float:
        """One ``nc_matmul`` (stationary ``[K, stationary_free]``, moving ``[K,
        moving_free]``, K <= 128): ``max(min(64, N_stationary), N_moving)`` TensorE cycles
        for 16-bit inputs, 4x for FP32, 0.5x for FP8 (``lane_rate``)."""
        return max(min(MIN_II_CYCLES, stationary_free), moving_free) / lane_rate(TENSOR, dtype)

    def matmul_time_us(self, m: int, k: int, n: int, dtype, batch: int = 1) -> float:
        """TensorE time of ``batch`` products ``[m, k] @ [k, n]``, tiled as ``nc_matmul``
        instructions: K in tiles of 128, one operand stationary in tiles of 128 columns, the
        other moving in tiles of at most 512 (whichever orientation is cheaper), each at
        :meth:`nc_matmul_cycles`; split over the logical core's physical cores."""
        if min(m, k, n, batch) <= 0:
            return 0.0
        cycles = batch * math.ceil(k / PMAX) * min(_tiled(m, n), _tiled(n, m)) / lane_rate(TENSOR, dtype)
        return cycles / self.lnc / CLOCK_HZ[TENSOR] * 1e6

    def tensor_time_us(self, flops: float, dtype) -> float:
        """TensorE time of ``flops`` at the array's peak (perfect tiles): convolution and
        attention, whose tiling the model does not follow."""
        if flops <= 0:
            return 0.0
        cycles = max(flops / (2 * PMAX * PMAX) / lane_rate(TENSOR, dtype), MIN_II_CYCLES)
        return cycles / self.lnc / CLOCK_HZ[TENSOR] * 1e6

    def dma_time_us(self, nbytes: float, transfers: int = 0, cores: int | None = None) -> float:
        """``nbytes`` through the DMA queues: at :attr:`dma_bytes_per_s` (``cores`` physical
        cores: their share of it), plus ``transfers`` x the fixed ~1.3 us of a transfer."""
        rate = self.dma_bytes_per_s if cores is None else self.dma_bytes_per_s * cores / self.lnc
        return nbytes / rate * 1e6 + transfers * DMA_FIXED_US

    def kernel_time_us(self, nbytes: float, engine_us=()) -> float:
        """A kernel's device time without the launch: the busiest of its DMA traffic and
        its engines (``engine_us``: microseconds per engine, in ``ENGINES`` order)."""
        memory_us = nbytes / self.dma_bytes_per_s * 1e6
        busiest = max(engine_us) if engine_us else 0.0
        return memory_us if memory_us > busiest else busiest

    # -- collectives -----------------------------------------------------------------
    def collective_transfer_us(self, nbytes: int, world_size: int, all_to_all: bool) -> float:
        """A ring collective's link time: each rank sends and receives (n-1)/n of the data,
        twice for an all-reduce (reduce-scatter, then all-gather). No launch overhead."""
        if world_size <= 1:
            return 0.0
        passes = 2 if all_to_all else 1
        traffic = passes * nbytes * (world_size - 1) / world_size
        return traffic / self.link_bandwidth_bytes_per_s * 1e6

    def collective_time_us(self, nbytes: int, world_size: int, all_to_all: bool) -> float:
        """A collective's time as the statistics report it: launch plus link time."""
        return self.launch_overhead_us + self.collective_transfer_us(nbytes, world_size, all_to_all)


def _tiled(stationary: int, moving: int) -> float:
    """Cycles (per K tile, 16-bit) of ``nc_matmul`` tiles covering ``stationary`` columns
    in tiles of 128 and ``moving`` columns in tiles of 512."""
    full_s, rest_s = divmod(stationary, PMAX)
    full_m, rest_m = divmod(moving, MOVING_FMAX)
    total = 0.0
    for s_tile, s_count in ((PMAX, full_s), (rest_s, 1 if rest_s else 0)):
        if not s_count:
            continue
        for m_tile, m_count in ((MOVING_FMAX, full_m), (rest_m, 1 if rest_m else 0)):
            if m_count:
                total += s_count * m_count * max(min(MIN_II_CYCLES, s_tile), m_tile)
    return total


PROFILE = DeviceProfile(lnc=CONFIG.lnc)  # the process's for good (NEURON_SIM_LNC, read at import)

# Ops timed by their own kernel's schedule (custom kernels): op -> fn(meta args, meta
# kwargs) -> device microseconds, the launch excluded (the queue adds it).
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
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
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

# -- which engine runs an op ------------------------------------------------------------------
# Matmuls tiled as nc_matmul: (index of A, of B) in the arguments; a 1-d B is a vector.
_MATMULS = {
    "aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2), "aten::baddbmm": (1, 2),
    "aten::mv": (0, 1), "aten::addmv": (1, 2), "aten::dot": (0, 1), "aten::vdot": (0, 1),
    "aten::addbmm": (1, 2),
}
# TensorE at its peak from the FLOPs (their tiling is not followed); attention also runs its
# softmax's exp on ScalarE, one per score.
_TENSOR_BY_FLOPS = {"aten::convolution", "aten::_convolution", "aten::convolution_backward",
                    "aten::cudnn_convolution", "aten::_convolution_double_backward"} | _ATTENTION_OPS
# DMA only: copies, casts (a DMA casts through FP32, nki/api/nki/isa/__init__.py L283-285)
# and concatenations move bytes and compute nothing.
_DMA_ONLY = {"copy", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "cat", "stack",
             "as_strided_copy", "expand_copy", "permute_copy", "t_copy", "transpose_copy", "view_copy",
             "slice_copy", "alias_copy", "unsqueeze_copy", "squeeze_copy", "lift_fresh_copy", "contiguous"}
# ScalarE's activation functions (exp, log, the sigmoid family, trigonometry, roots): one
# per output element. Their backwards also multiply by the gradient on VectorE.
_TRANSCENDENTAL = {
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "logit", "tanh", "sin", "cos", "tan",
    "asin", "acos", "atan", "atan2", "arctan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv",
    "sqrt", "rsqrt", "reciprocal", "pow", "float_power", "gelu", "silu", "mish", "softplus", "elu", "selu", "celu",
    "log_sigmoid_forward", "lgamma", "digamma", "sinc", "xlogy", "special_erfcx", "logaddexp", "logaddexp2",
}
_ACTIVATION_BACKWARDS = {"gelu_backward", "silu_backward", "mish_backward", "softplus_backward", "elu_backward",
                         "log_sigmoid_backward", "logit_backward"}
# Softmax-like: an exp per input element on ScalarE, a max and a normalization on VectorE.
_SOFTMAX = {"_softmax", "_log_softmax", "logsumexp", "_safe_softmax"}
_SOFTMAX_BACKWARDS = {"_log_softmax_backward_data"}  # the exp of the saved output on ScalarE
# GpSimdE despite an elementwise form: iota (arange), affine_select (triu, tril), random draws
# (the Vector engine's dropout excepted, nki/api/nki/isa/__init__.py L527-531).
_GPSIMD = {"arange", "linspace", "logspace", "triu", "tril", "randperm", "multinomial"}
_VECTOR_EXTRA = {"fill", "zero", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
                 "scalar_tensor", "where", "masked_fill", "_masked_scale", "native_dropout",
                 "native_dropout_backward", "lerp", "addcmul", "addcdiv", "threshold_backward",
                 "sigmoid_backward", "tanh_backward", "hardtanh_backward", "leaky_relu_backward",
                 "_softmax_backward_data", "var_mean", "linalg_vector_norm", "norm", "native_layer_norm",
                 "native_layer_norm_backward", "native_group_norm", "native_batch_norm",
                 "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                 "native_batch_norm_backward", "_foreach_norm", "_foreach_max"}


def _base_name(schema_name: str) -> str:
    """``aten::_foreach_sqrt_`` -> ``sqrt``; ``aten::add_`` -> ``add``; ``aten::exp`` -> ``exp``."""
    name = schema_name.split("::", 1)[-1]
    if name.startswith("_foreach_") and name not in ("_foreach_norm", "_foreach_max"):
        name = name[len("_foreach_"):]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def _matmul_dims(op_name: str, args) -> tuple | None:
    """(batch, m, k, n) of a matmul from its meta arguments, or None."""
    a_at, b_at = _MATMULS[op_name]
    if len(args) <= b_at or not isinstance(args[a_at], torch.Tensor) or not isinstance(args[b_at], torch.Tensor):
        return None
    a, b = args[a_at], args[b_at]
    if a.dim() == 1 and b.dim() == 1:  # dot
        return 1, 1, a.shape[0], 1
    if b.dim() == 1:  # mv: [m, k] @ [k]
        return 1, a.shape[0], a.shape[1], 1
    if a.dim() == 3:  # bmm, baddbmm, addbmm: [B, m, k] @ [B, k, n]
        return a.shape[0], a.shape[1], a.shape[2], b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 1, a.shape[0], a.shape[1], b.shape[1]
    return None


def _attention_scores(args) -> int:
    """Scores of an attention op (one exp each): batch x queries x keys."""
    q, k = args[0], args[1]
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2:
        return 0
    return math.prod(q.shape[:-1]) * k.shape[-2]


def engine_work(op, args, kwargs, read, written, flops: float, dtype, profile=None) -> tuple:
    """Microseconds of each engine (``ENGINES`` order) for one op, from its meta tensors:
    ``read`` and ``written`` are the tensors it reads and writes (module docstring)."""
    profile = profile or PROFILE
    name = op._schema.name
    read_elements = sum(t.numel() for t in _tensors(read))
    written_elements = sum(t.numel() for t in _tensors(written))
    tensor = vector = scalar = gpsimd = 0.0
    if name in _MATMULS:
        dims = _matmul_dims(name, args)
        if dims is None:
            tensor = profile.tensor_time_us(flops, dtype)
        else:
            batch, m, k, n = dims
            tensor = profile.matmul_time_us(m, k, n, dtype, batch)
    elif name in _TENSOR_BY_FLOPS:
        tensor = profile.tensor_time_us(flops, dtype)
        if name in _ATTENTION_OPS:
            scalar = profile.engine_time_us(SCALAR, _attention_scores(args), dtype)
    else:
        base = _base_name(name)
        elements = max(read_elements, written_elements)
        if base in _DMA_ONLY:
            pass
        elif base in _SOFTMAX:
            scalar = profile.engine_time_us(SCALAR, read_elements, dtype)
            vector = profile.engine_time_us(VECTOR, 2 * read_elements, dtype)
        elif base in _SOFTMAX_BACKWARDS:
            scalar = profile.engine_time_us(SCALAR, written_elements, dtype)
            vector = profile.engine_time_us(VECTOR, elements, dtype)
        elif base in _TRANSCENDENTAL:
            scalar = profile.engine_time_us(SCALAR, written_elements or elements, dtype)
        elif base in _ACTIVATION_BACKWARDS:
            scalar = profile.engine_time_us(SCALAR, written_elements, dtype)
            vector = profile.engine_time_us(VECTOR, elements, dtype)
        elif base in _GPSIMD or (torch.Tag.nondeterministic_seeded in op.tags and base != "native_dropout"):
            gpsimd = profile.engine_time_us(GPSIMD, elements, dtype)
        elif (base in _VECTOR_EXTRA or name.startswith("aten::_foreach_") or torch.Tag.pointwise in op.tags
              or torch.Tag.reduction in op.tags):
            vector = profile.engine_time_us(VECTOR, elements, dtype)
        else:  # index, gather, scatter, sort, cumsum ...: the general-purpose engine
            gpsimd = profile.engine_time_us(GPSIMD, elements, dtype)
    return (tensor, vector, scalar, gpsimd)


class OpCost:
    """What one op costs the device, from its meta tensors (cached per signature).

    - ``bytes``, ``flops``, ``time_us``: the op as a kernel of its own, ``time_us`` without
      the launch overhead (the queue adds it when it accounts for the launch);
    - ``engine_us``: microseconds on each engine (``ENGINES`` order: tensor, vector,
      scalar, gpsimd), which a fused kernel sums over its ops;
    - ``read_bytes``/``write_bytes``/``result_bytes``: per device tensor read, per tensor
      mutated in place, per fresh output (aligned with the record's ``reads``, ``writes``
      and ``results``), so a fused kernel can count only what crosses its boundary;
    - ``numel``: elements of the first tensor it writes (its iteration space);
      ``input_numel``: elements of its largest input.
    """

    __slots__ = ("bytes", "flops", "time_us", "engine_us", "read_bytes", "write_bytes", "result_bytes", "numel",
                 "input_numel")

    def __init__(self, nbytes, flops, time_us, engine_us, read_bytes, write_bytes, result_bytes, numel, input_numel):
        self.bytes = nbytes
        self.flops = flops
        self.time_us = time_us
        self.engine_us = engine_us
        self.read_bytes = read_bytes
        self.write_bytes = write_bytes
        self.result_bytes = result_bytes
        self.numel = numel
        self.input_numel = input_numel

    @property
    def busiest_engine(self) -> str:
        return ENGINES[max(range(len(ENGINES)), key=lambda i: self.engine_us[i])]

    def __repr__(self) -> str:
        engines = ", ".join(f"{e}={us:.3f}" for e, us in zip(ENGINES, self.engine_us) if us)
        return f"OpCost(bytes={self.bytes}, flops={self.flops:.0f}, time_us={self.time_us:.3f}, {engines or 'dma only'})"


def op_cost(op, args, kwargs, written, read_bytes=(), write_bytes=(), result_bytes=(), profile=None) -> OpCost:
    """The cost of one op on meta (or real) tensors: every tensor argument is read, every
    written tensor (outputs, and arguments mutated in place) is written."""
    profile = profile or PROFILE
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
        engine_us = engine_work(op, args, kwargs, read, written, flops, dtype, profile)
        time_us = profile.kernel_time_us(nbytes, engine_us)
    else:  # a custom kernel: its own schedule (never fused, so no per-engine split is kept)
        engine_us = [0.0] * len(ENGINES)
        time_us = timer(args, kwargs)
    return OpCost(
        nbytes,
        flops,
        time_us,
        engine_us,
        tuple(read_bytes),
        tuple(write_bytes),
        tuple(result_bytes),
        written[0].numel() if written else 0,
        max((t.numel() for t in inputs), default=0),
    )
