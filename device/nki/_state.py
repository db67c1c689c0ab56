"""The running kernel: errors at the kernel's line, on-chip memory accounting, the trace.

One :class:`Program` per SPMD program (per thread for ``kernel[2]``), reachable through
:func:`current`. It holds what a NeuronCore holds while a kernel runs: SBUF and PSUM occupancy,
the engines' accumulator registers, the PRNG, and the instruction trace.
"""
from __future__ import annotations

import dataclasses
import gc
import linecache
import os
import sys
import threading

import numpy as np

from . import cost as _cost

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class NkiValidationError(AssertionError):
    """A hardware constraint the kernel breaks (``nki.isa.NkiValidationError``).

    An ``AssertionError`` as well, as the SDK simulator raises. ``instruction`` is the NKI call
    that failed, ``location`` the kernel's own source line ``(file, line, function, text)``."""

    def __init__(self, message, instruction=None, location=None):
        super().__init__(message)
        self.instruction = instruction
        self.location = location


NkiValidationError.__module__ = "nki.isa"  # where the API reference documents it


def user_frame(depth: int = 1):
    """The innermost frame outside this package: the kernel line that called into NKI."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return ("<unknown>", 0, "<unknown>", "")
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    return (filename, lineno, frame.f_code.co_name, linecache.getline(filename, lineno).strip())


def where(location) -> str:
    filename, lineno, func, text = location
    return f"{os.path.basename(filename)}:{lineno} in {func}: {text}"


def fail(instruction: str, message: str):
    """Raise a :class:`NkiValidationError` naming ``instruction`` and the kernel's line."""
    location = user_frame(2)
    raise NkiValidationError(f"{instruction}: {message}\n  at {where(location)}", instruction, location)


def trim_traceback(error: BaseException):
    """``error``'s traceback cut after the kernel's own frame, so that the innermost frame
    shown is the kernel line that made the failing call, not the simulator's internals."""
    tb = error.__traceback__
    last_user = None
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            last_user = tb
        tb = tb.tb_next
    if last_user is not None:
        last_user.tb_next = None
    return error


# -- on-chip memory ----------------------------------------------------------------------


class OnChipMemory:
    """Occupancy of SBUF or PSUM, per partition, while a kernel runs.

    A tensor allocated without an address occupies its bytes per partition (PSUM: whole 2 KiB
    banks, as allocations start at a bank boundary) on partitions ``[0, P)`` for as long as the
    kernel holds a reference to it or to a view of it: the simulator's stand-in for the
    compiler's liveness-based allocation. A tensor allocated at an explicit ``address=(partition,
    byte_offset)`` (nki-library's SbufManager) occupies that interval; overlapping intervals count
    once (allocators reuse addresses across scopes). Exceeding the capacity raises.
    """

    def __init__(self, kind: str, capacity: int, unit: int):
        self.kind = kind  # "SBUF" or "PSUM"
        self.capacity = capacity  # bytes per partition
        self.unit = unit  # allocation granule in bytes (1 for SBUF, a 2 KiB bank for PSUM)
        self.auto = np.zeros(128, dtype=np.int64)
        self.live = {}  # id -> (p0, p1, lo, hi, auto, label)
        self.peak = 0
        self._next = 0

    def _span(self, nbytes):
        return -(-nbytes // self.unit) * self.unit

    def usage(self) -> np.ndarray:
        used = self.auto.copy()
        explicit = [v for v in self.live.values() if not v[4]]
        if explicit:
            cuts = sorted({0, 128} | {v[0] for v in explicit} | {v[1] for v in explicit})
            for a, b in zip(cuts, cuts[1:]):
                spans = sorted((lo, hi) for p0, p1, lo, hi, _, _ in explicit if p0 <= a and b <= p1)
                total, end = 0, -1
                for lo, hi in spans:
                    if hi > end:
                        total += hi - max(lo, end, 0)
                        end = hi
                used[a:b] += total
        return used

    def allocate(self, partitions: int, nbytes: int, address, label: str, instruction: str) -> int:
        if address is None:
            p0, p1, lo, hi, auto = 0, partitions, 0, self._span(nbytes), True
        else:
            p0 = int(address[0])
            lo = int(address[1])
            p1, hi, auto = p0 + partitions, lo + self._span(nbytes) if self.unit > 1 else lo + nbytes, False
            if self.unit > 1:
                lo = lo // self.unit * self.unit
            if p1 > 128 or hi > self.capacity or lo < 0:
                fail(instruction, f"{label} at address {tuple(address)} needs partitions [{p0}, {p1}) and bytes "
                     f"[{lo}, {hi}) per partition, outside the {self.kind} (128 partitions x {self.capacity} bytes)")
        if hi - lo > self.capacity:
            fail(instruction, f"{self.kind} overflow: {label} needs {hi - lo} bytes per partition; one "
                 f"{self.kind} partition holds {self.capacity} bytes")
        ident = self._next
        self._next += 1
        self.live[ident] = (p0, p1, lo, hi, auto, label)
        if auto:
            self.auto[p0:p1] += hi - lo
        used = int(self.usage().max())
        if used > self.capacity:
            gc.collect()  # tensors only reachable through reference cycles
            used = int(self.usage().max())
        if used > self.capacity:
            self.release(ident)
            holders = sorted(self.live.values(), key=lambda v: v[2] - v[3])[:4]
            names = ", ".join(f"{v[5]} ({v[3] - v[2]} B)" for v in holders)
            fail(instruction, f"{self.kind} overflow: {label} needs {hi - lo} bytes per partition, but "
                 f"{used - (hi - lo) if auto else used} of the {self.capacity} bytes per partition are "
                 f"held by {len(self.live)} live tensors (largest: {names}); capacity of one NeuronCore-v3: "
                 f"{self.kind} = 128 partitions x {self.capacity} bytes")
        self.peak = max(self.peak, used)
        return ident

    def release(self, ident: int):
        entry = self.live.pop(ident, None)
        if entry is not None and entry[4]:
            self.auto[entry[0]:entry[1]] -= entry[3] - entry[2]


# -- the running program -------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    """One executed instruction: what the cost model and the report need.

    ``reads``/``writes`` are ``(storage id, first byte, end byte)`` ranges, for the scheduler's
    data dependencies. ``shapes``/``dtypes`` list the operands, destination first.
    """

    name: str
    engine: str
    shapes: tuple
    dtypes: tuple
    bytes: int
    line: str
    partitions: int = 1
    elements: int = 1  # elements per partition of the largest operand
    reads: tuple = ()
    writes: tuple = ()
    info: dict = dataclasses.field(default_factory=dict)
    program: int = 0
    cost_ns: float = 0.0
    start_ns: float = 0.0
    end_ns: float = 0.0

    def summary(self) -> str:
        shapes = " ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.name:<20} {self.engine:<8} {shapes:<30} {self.bytes:>9} B  {self.line}"


class Shared:
    """What the programs of one launch share: shared HBM, the barrier, the send/recv pipes."""

    def __init__(self, nprograms: int):
        self.nprograms = nprograms
        self.barrier = threading.Barrier(nprograms) if nprograms > 1 else None
        self.pipes = {}
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.storage_ids = 0
        self.shared_hbm = []  # the shared_hbm storages of this launch, by allocation order

    def next_id(self) -> int:
        with self.lock:
            self.storage_ids += 1
            return self.storage_ids


class Program:
    def __init__(self, kernel_name: str, grid: tuple, program_id: tuple, shared: Shared, index: int = 0):
        self.kernel_name = kernel_name
        self.grid = grid
        self.program_id = program_id
        self.index = index
        self.shared = shared
        self.sbuf = OnChipMemory("SBUF", _cost.SBUF_BYTES_PER_PARTITION, 1)
        self.psum = OnChipMemory("PSUM", _cost.PSUM_BYTES_PER_PARTITION, _cost.PSUM_BANK_BYTES)
        self.trace: list[Instruction] = []
        self.scalar_acc = np.zeros(128, dtype=np.float32)  # ScalarE reduce_regs
        self.vector_acc = np.zeros(128, dtype=np.float32)  # VectorE accumulator registers
        self.rng = np.random.default_rng(0)
        self.shared_allocs = 0
        self.active = True

    def record(self, instruction: Instruction):
        instruction.program = self.index
        self.trace.append(instruction)


_LOCAL = threading.local()


def current(what: str = "this NKI call") -> Program:
    program = getattr(_LOCAL, "program", None)
    if program is None or not program.active:
        location = user_frame(2)
        raise NkiValidationError(
            f"{what}: called outside an NKI kernel; run kernels with nki.simulate(kernel)(*arrays) "
            f"or call an @nki.jit kernel\n  at {where(location)}", what, location)
    return program


def maybe_current():
    program = getattr(_LOCAL, "program", None)
    return program if program is not None and program.active else None


def set_current(program):
    previous = getattr(_LOCAL, "program", None)
    _LOCAL.program = program
    return previous
