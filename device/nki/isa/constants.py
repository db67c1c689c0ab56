"""``nki.isa.constants``: the ISA configuration enums (``nki/api/nki/isa/__init__.py``)."""
from __future__ import annotations

import enum


class engine(enum.Enum):
    """Neuron Device engines."""

    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


class reduce_cmd(enum.Enum):
    """Engine register reduce commands."""

    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):
    """Descriptor Generation Engine mode."""

    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    """Out-of-bounds access mode."""

    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    """Performance mode for matmul."""

    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):
    """NeuronCore version (ordered: kernels test ``get_nc_version() >= nc_version.gen3``)."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __lt__(self, other):
        return self.value < other.value if isinstance(other, nc_version) else NotImplemented

    def __le__(self, other):
        return self.value <= other.value if isinstance(other, nc_version) else NotImplemented

    def __gt__(self, other):
        return self.value > other.value if isinstance(other, nc_version) else NotImplemented

    def __ge__(self, other):
        return self.value >= other.value if isinstance(other, nc_version) else NotImplemented


class dma_engine(enum.Enum):
    """DMA transfer engine."""

    dma = 1
    gpsimd_dma = 2


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown

__all__ = ["engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine",
           "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine"]
