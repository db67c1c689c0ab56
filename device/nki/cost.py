"""What an NKI kernel costs on one NeuronCore-v3 (Trainium2): per-instruction engine time and
the engines' schedule.

Every constant is a row of :data:`FIGURES` with its source (a path in ``aws-neuron/aws-neuron-sdk``
at 81ce03ae, or the older snapshot that still had per-instruction cost formulas, 1db4d74e), or is
marked as an assumption. The figures were collected in /work/notes/trn2_figures.md (row numbers
given as "fig 2.1" etc.). The lead moves them into ``device/cost_model.py``'s device profile later.

Instruction time (:func:`instruction_cost`): the published cycle formula of the instruction
(``max(MIN_II, N)`` engine cycles and the like; N = elements per partition, the 128 lanes work in
parallel so the partition count does not matter) at the engine's NeuronCore-v3 clock. Those
formulas were published without a generation (SDK-OLD); using them at NC-v3 clocks is an
assumption. DMA: bytes over the bandwidth of the DMA engines the transfer spreads over (8
partitions per engine, at most 16 engines, 23 B/ns each), plus a fixed completion latency.

Kernel time (:func:`schedule`): instructions run in program order on their engine (each engine has
one in-order instruction stream); an instruction starts when its engine is free and the
instructions it depends on (read-after-write, write-after-read, write-after-write on overlapping
bytes of the same tensor) have finished. Engines overlap otherwise. The 16 DMA engines are a pool:
a transfer occupies the ones it spreads over, and its completion latency does not occupy them.
The kernel's simulated time is the last instruction's end plus one launch.
"""
from __future__ import annotations

import dataclasses
import math
import os

SDK = "aws-neuron/aws-neuron-sdk@81ce03ae"
SDK_OLD = "aws-neuron/aws-neuron-sdk@1db4d74e nki/api/nki/isa/__init__.py ('Estimated instruction cost')"

#: (name, value, unit, source): one row per constant below, each with its source.
FIGURES: list[tuple[str, float, str, str]] = []


def _figure(name, value, unit, source):
    FIGURES.append((name, value, unit, source))
    return value


SBUF_BYTES_PER_PARTITION = _figure("SBUF_BYTES_PER_PARTITION", 224 * 1024, "bytes",
    f"{SDK} nki/guides/architecture/trainium2_arch.rst L39: 'SBUF capacity is 28MiB (or, 128 partitions of 224KiB)' (fig 2.20)")
SBUF_USABLE_BYTES_PER_PARTITION = _figure("SBUF_USABLE_BYTES_PER_PARTITION", 224 * 1024 - 16384 - 8, "bytes",
    "aws-neuron/nki-library@d2ad3a57 core/mlp/mlp_cte/mlp_cte_constants.py L46-47: 224 KiB minus DynamicDMAScratchLoc "
    "(16384) minus EvalAccelReservedLoc (8) (fig 2.22; the kernel's own 256-byte identity tile not subtracted)")
PSUM_BYTES_PER_PARTITION = _figure("PSUM_BYTES_PER_PARTITION", 16 * 1024, "bytes",
    f"{SDK} nki/migration/index.rst L1108-1112: '128 partitions, each consisting of 16KB' (fig 2.24)")
PSUM_BANK_BYTES = _figure("PSUM_BANK_BYTES", 2 * 1024, "bytes",
    f"{SDK} nki/migration/index.rst L1108-1112: '8 PSUM banks, with each bank holding up to 2KB'; allocations start at a bank (fig 2.24)")
PMAX = _figure("PMAX", 128, "partitions", f"{SDK} nki/get-started/about/tiling-overview.rst L96 (fig 3.1)")
PSUM_FMAX = _figure("PSUM_FMAX", 512, "fp32 elements", f"{SDK} nki/get-started/about/tiling-overview.rst L97 (fig 3.1)")
GEMM_STATIONARY_FMAX = _figure("GEMM_STATIONARY_FMAX", 128, "elements", f"{SDK} nki/get-started/about/tiling-overview.rst L98 (fig 3.1)")
GEMM_MOVING_FMAX = _figure("GEMM_MOVING_FMAX", 512, "elements", f"{SDK} nki/get-started/about/tiling-overview.rst L98; isa nc_matmul L612-615 (fig 3.1, 3.2)")
ENGINE_SBUF_FMAX = _figure("ENGINE_SBUF_FMAX", 64 * 1024, "elements", f"{SDK} nki/guides/architecture/trainium_inferentia2_arch.rst L335-338: "
    "'the free dimension size can be up to 64K elements for SBUF or 4K elements for PSUM' (Vector/Scalar/GpSimd "
    "instructions; published for NC-v2, assumed for NC-v3) (fig 3.2c)")
ENGINE_PSUM_FMAX = _figure("ENGINE_PSUM_FMAX", 4 * 1024, "elements", f"{SDK} nki/guides/architecture/trainium_inferentia2_arch.rst L335-338 (fig 3.2c)")
BN_STATS_FMAX = _figure("BN_STATS_FMAX", 512, "elements", f"{SDK} nki/api/nki/isa/__init__.py bn_stats: 'must not exceed 512 (nl.tile_size.bn_stats_fmax)'")
TENSOR_GHZ = _figure("TENSOR_GHZ", 2.4, "GHz", f"{SDK} nki/guides/architecture/trainium2_arch.rst L41-64 (fig 2.1)")
VECTOR_GHZ = _figure("VECTOR_GHZ", 0.96, "GHz", f"{SDK} nki/guides/architecture/trainium2_arch.rst L41-64 (fig 2.1)")
SCALAR_GHZ = _figure("SCALAR_GHZ", 1.2, "GHz", f"{SDK} nki/guides/architecture/trainium2_arch.rst L41-64 (fig 2.1)")
GPSIMD_GHZ = _figure("GPSIMD_GHZ", 1.2, "GHz", f"{SDK} nki/guides/architecture/trainium2_arch.rst L41-64 (fig 2.1)")
SYNC_GHZ = _figure("SYNC_GHZ", 1.2, "GHz", f"{SDK} tools/neuron-explorer/profile-schema-reference.rst L3368: 'Trainium2 is 1.2 GHz' "
    "NeuronCore base clock (fig 2.2); the Sync engine's own clock is not published (assumption)")
MIN_II = _figure("MIN_II", 64, "engine cycles", f"{SDK_OLD}: 'MIN_II is roughly 64 engine cycles' (no generation given; fig 3.12ff)")
MM_INIT_LATENCY = _figure("MM_INIT_LATENCY", 64, "TensorE cycles", f"{SDK_OLD} nc_matmul L897-916: max(min(64, N_stationary), N_moving) (fig 3.10)")
FP32_MATMUL_FACTOR = _figure("FP32_MATMUL_FACTOR", 4.0, "x", f"{SDK} tools/neuron-explorer/profile-schema-reference.rst L2126: 'FP32 uses 4.0x' (fig 2.8)")
FP8_DOUBLE_ROW_FACTOR = _figure("FP8_DOUBLE_ROW_FACTOR", 0.5, "x", f"{SDK} tools/neuron-explorer/profile-schema-reference.rst L2126: 'FP8 ... 0.5x on Trn2' (fig 2.8)")
VECTOR_PERF_MODE_4X = _figure("VECTOR_PERF_MODE_4X", 4.0, "x", f"{SDK} nki/guides/architecture/trainium2_arch.rst L222-240: tensor_copy/tensor_scalar, "
    "SBUF->SBUF, BF16/FP16, contiguous innermost: 4x (fig 2.13)")
VECTOR_PERF_MODE_2X = _figure("VECTOR_PERF_MODE_2X", 2.0, "x", f"{SDK} nki/guides/architecture/trainium2_arch.rst L222-240: the other BF16/FP16 cases (fig 2.13)")
GPSIMD_START = _figure("GPSIMD_START", 150, "GpSimd cycles", f"{SDK_OLD} iota/affine_select L565-567: 'GPSIMD_START ... roughly 150 engine cycles' (fig 3.26)")
DMA_ENGINES = _figure("DMA_ENGINES", 16, "engines", f"{SDK} nki/get-started/about/nki-dma-overview.rst L7: 'paired with 16 DMA engines' (fig 2.28)")
DMA_PARTITIONS_PER_ENGINE = _figure("DMA_PARTITIONS_PER_ENGINE", 8, "partitions", f"{SDK} nki/get-started/about/nki-dma-overview.rst L34: 'eight SBUF partitions (128 partitions / 16 DMA engines)' (fig 2.32)")
DMA_BYTES_PER_NS_PER_ENGINE = _figure("DMA_BYTES_PER_NS_PER_ENGINE", 23.0, "B/ns", f"{SDK} nki/get-started/about/nki-dma-overview.rst L46-63: 'Trainium2 - 23 B/ns - 16 - 368 GB/s' (fig 2.29)")
DMA_LATENCY_NS = _figure("DMA_LATENCY_NS", 1300.0, "ns", f"{SDK} nki/deep-dives/nki-dma-bandwidth-guide.rst L39-41: 'semaphore-to-start latency (~1300 ns cross-engine)' (fig 2.34)")
DMA_TRANSPOSE_EFFICIENCY_HBM = _figure("DMA_TRANSPOSE_EFFICIENCY_HBM", 0.9, "x", f"{SDK} nki/guides/architecture/trainium2_arch.rst L321: 'up to 90% DMA throughput' (fig 2.37)")
DMA_TRANSPOSE_EFFICIENCY_SBUF = _figure("DMA_TRANSPOSE_EFFICIENCY_SBUF", 0.5, "x", f"{SDK} nki/guides/architecture/trainium2_arch.rst L340: 'up to 50%' (fig 2.37)")
LAUNCH_US = _figure("LAUNCH_US", float(os.environ.get("NEURON_SIM_LAUNCH_US", 10.0)), "us",
    "ASSUMPTION, the same as device/cost_model.py's launch_overhead_us (NEURON_SIM_LAUNCH_US): no per-launch runtime "
    "overhead is published (fig 'Not published')")

ENGINE_GHZ = {"TensorE": TENSOR_GHZ, "VectorE": VECTOR_GHZ, "ScalarE": SCALAR_GHZ, "GpSimd": GPSIMD_GHZ,
              "Sync": SYNC_GHZ}
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimd", "DMA", "Sync")


def _bf16ish(dtypes) -> bool:
    return all(str(d) in ("bfloat16", "float16") for d in dtypes)


def instruction_cycles(ins) -> float:
    """Engine cycles of one instruction (not for DMA)."""
    n = max(1, ins.elements)
    name = ins.name
    info = ins.info
    min_ii = MIN_II
    if name in ("nc_matmul", "nc_transpose") and ins.engine == "TensorE":
        if name == "nc_transpose":
            p, f = info.get("P", n), info.get("F", n)
            return max(p, min(64, f))
        cycles = max(min(MM_INIT_LATENCY, info.get("N_stationary", 128)), info.get("N_moving", n))
        if info.get("fp32"):
            cycles *= FP32_MATMUL_FACTOR
        elif info.get("double_row"):
            cycles *= FP8_DOUBLE_ROW_FACTOR
        return cycles
    if name == "nc_transpose":
        return max(min_ii, n)
    if name in ("activation", "activation_reduce", "activate2"):
        return max(min_ii, n) + (min_ii if info.get("reads_accumulator") else 0)
    if name == "tensor_tensor":
        fast = info.get("one_psum") or (info.get("all_sbuf") and _bf16ish(ins.dtypes)
                                        and info.get("op") in ("add", "multiply", "subtract") and info.get("contiguous"))
        return max(min_ii, n if fast else 2 * n)
    if name in ("tensor_scalar", "tensor_copy"):
        cycles = n
        if ins.engine == "VectorE" and _bf16ish(ins.dtypes):
            if info.get("all_sbuf") and info.get("contiguous"):
                cycles = n / VECTOR_PERF_MODE_4X
            else:
                cycles = n / VECTOR_PERF_MODE_2X
        return max(min_ii, cycles)
    if name in ("tensor_scalar_reduce", "select_reduce", "tensor_scalar_cumulative"):
        return max(min_ii, n) + min_ii
    if name == "tensor_reduce":
        fast = _bf16ish(ins.dtypes) and info.get("op") in ("add", "maximum")
        return n / 2 if fast else n
    if name == "tensor_tensor_scan":
        return max(min_ii, 2 * n)
    if name == "reciprocal":
        return max(min_ii, 8 * n)
    if name == "memset":
        zero16 = info.get("zero") and _bf16ish(ins.dtypes[:1])
        return max(min_ii, n / 2 if zero16 else n)
    if name in ("iota", "affine_select"):
        return GPSIMD_START + n
    if name in ("max8", "nc_find_index8"):
        return n
    if name == "nc_match_replace8":
        return max(min_ii, n)
    if name == "scalar_tensor_tensor":
        fast = _bf16ish(ins.dtypes[1:]) and info.get("ops") == ("subtract", "multiply") and n % 2 == 0
        return n if fast else 2 * n
    if name == "bn_stats":
        return max(min_ii, n)
    if name == "bn_aggr":
        return max(min_ii, 13 * (n / 3))
    if name == "tensor_copy_predicated":
        return max(min_ii, 2 * n if info.get("all_sbuf") else n)
    if name == "topk":
        return 4 * info.get("n", n) + info.get("k", 8)
    if name in ("local_gather", "nc_n_gather"):
        return GPSIMD_START + n  # simplified: one element per cycle after the start
    if ins.engine == "GpSimd":
        return GPSIMD_START + n  # assumption for GpSimd instructions without a formula
    if ins.engine == "Sync":
        return min_ii  # register moves, barriers: assumption
    return max(min_ii, n)  # dropout, nc_stream_shuffle, range_select, ... (SDK_OLD max(MIN_II, N))


def dma_engines_used(ins) -> int:
    rows = max(1, ins.info.get("rows", ins.partitions))
    return max(1, min(DMA_ENGINES, math.ceil(rows / DMA_PARTITIONS_PER_ENGINE)))


def instruction_cost(ins) -> tuple[float, float]:
    """(occupancy ns, extra latency ns) of one instruction on its engine."""
    if ins.engine == "DMA":
        engines = dma_engines_used(ins)
        bandwidth = engines * DMA_BYTES_PER_NS_PER_ENGINE
        efficiency = ins.info.get("efficiency", 1.0)
        return ins.bytes / (bandwidth * efficiency), DMA_LATENCY_NS
    return instruction_cycles(ins) / ENGINE_GHZ[ins.engine], 0.0


@dataclasses.dataclass
class Schedule:
    """The result of :func:`schedule`: times in nanoseconds."""

    device_ns: float  # last instruction's end (all programs; they run on separate cores)
    launch_ns: float
    busy_ns: dict  # engine -> summed occupancy (all programs)
    count: dict  # engine -> instructions
    critical_engine: str

    @property
    def total_ns(self) -> float:
        return self.device_ns + self.launch_ns

    @property
    def total_us(self) -> float:
        return self.total_ns / 1000.0


class _Deps:
    """Last accesses per tensor storage: rectangles (partitions x bytes) with their end times."""

    def __init__(self):
        self.entries = {}

    def ready(self, reads, writes) -> float:
        t = 0.0
        for sid, p0, p1, b0, b1 in reads:
            for q0, q1, c0, c1, end, is_write in self.entries.get(sid, ()):
                if is_write and end > t and q0 < p1 and p0 < q1 and c0 < b1 and b0 < c1:
                    t = end
        for sid, p0, p1, b0, b1 in writes:
            for q0, q1, c0, c1, end, _ in self.entries.get(sid, ()):
                if end > t and q0 < p1 and p0 < q1 and c0 < b1 and b0 < c1:
                    t = end
        return t

    def add(self, reads, writes, end):
        for sid, p0, p1, b0, b1 in writes:
            old = self.entries.get(sid, [])
            old = [e for e in old if not (p0 <= e[0] and e[1] <= p1 and b0 <= e[2] and e[3] <= b1)]
            old.append((p0, p1, b0, b1, end, True))
            self.entries[sid] = old
        for sid, p0, p1, b0, b1 in reads:
            self.entries.setdefault(sid, []).append((p0, p1, b0, b1, end, False))
        for sid in {r[0] for r in reads} | {w[0] for w in writes}:
            lst = self.entries[sid]
            if len(lst) > 64:  # bound the work: merge the oldest half into one pessimistic entry
                half, rest = lst[:32], lst[32:]
                merged = (min(e[0] for e in half), max(e[1] for e in half), min(e[2] for e in half),
                          max(e[3] for e in half), max(e[4] for e in half), True)
                self.entries[sid] = [merged] + rest


def schedule(trace, launch: bool = True) -> Schedule:
    """Schedule ``trace`` (a list of ``Instruction``) on the engines; fills each instruction's
    ``cost_ns``, ``start_ns`` and ``end_ns``."""
    programs = {}
    for ins in trace:
        programs.setdefault(ins.program, []).append(ins)
    busy = {e: 0.0 for e in ENGINES}
    count = {e: 0 for e in ENGINES}
    device_end = 0.0
    for _, instructions in sorted(programs.items()):
        free = {e: 0.0 for e in ENGINES if e != "DMA"}
        dma = [0.0] * DMA_ENGINES
        deps = _Deps()
        for ins in instructions:
            occupancy, latency = instruction_cost(ins)
            ready = deps.ready(ins.reads, ins.writes)
            if ins.engine == "DMA":
                n = dma_engines_used(ins)
                chosen = sorted(range(len(dma)), key=dma.__getitem__)[:n]
                start = max(ready, max(dma[i] for i in chosen))
                for i in chosen:
                    dma[i] = start + occupancy
            else:
                start = max(ready, free[ins.engine])
                free[ins.engine] = start + occupancy
            end = start + occupancy + latency
            ins.cost_ns, ins.start_ns, ins.end_ns = occupancy, start, end
            deps.add(ins.reads, ins.writes, end)
            busy[ins.engine] += occupancy
            count[ins.engine] += 1
            device_end = max(device_end, end)
    critical = max(busy, key=busy.get) if trace else "none"
    return Schedule(device_end, LAUNCH_US * 1000.0 if launch else 0.0, busy, count, critical)


def figures_table() -> str:
    """The figures as a Markdown table (for the report and the README)."""
    lines = ["| constant | value | unit | source |", "|---|---|---|---|"]
    for name, value, unit, source in FIGURES:
        lines.append(f"| {name} | {value} | {unit} | {source} |")
    return "\n".join(lines)
