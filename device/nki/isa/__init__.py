"""``nki.isa``: the NeuronCore-v3 instructions, simulated on numpy.

Each function follows its docstring in ``nki/api/nki/isa/__init__.py`` (aws-neuron-sdk): the
output is the ``dst`` argument, operands are checked as the hardware requires (partition
dimension <= 128, the buffers each engine can reach, matching shapes, dtypes), the arithmetic is
float32 with the result cast to ``dst.dtype`` (bitvec operators work on the integer bits), and
each executed instruction is recorded in the running program's trace with its engine, operand
shapes, dtypes, bytes and the kernel's source line (``nki.cost`` turns the trace into time).
A broken constraint raises :class:`NkiValidationError` naming the instruction and the kernel line.
"""
from __future__ import annotations

from .._state import NkiValidationError  # noqa: F401
from . import constants  # noqa: F401
from ._call import FP32_MIN, NkiInstruction, VirtualRegister, _Call  # noqa: F401
from .constants import (dge_mode, dma_engine, engine, gpsimd_engine, matmul_perf_mode, nc_version,  # noqa: F401
                        oob_mode, reduce_cmd, scalar_engine, tensor_engine, unknown_engine, vector_engine)
from .gpsimd import (affine_select, iota, local_gather, nc_n_gather, nonzero_with_count, rand_get_state,  # noqa: F401
                     rand_set_state, range_select, rng, select_reduce, sequence_bounds, set_rng_seed, topk, dropout)
from .movement import dma_compute, dma_copy, dma_transpose, memset, tensor_copy, tensor_copy_predicated  # noqa: F401
from .scalar import activate2, activation, activation_reduce, exponential, rand2  # noqa: F401
from .sync import (core_barrier, get_nc_sub_version, get_nc_version, register_alloc, register_load,  # noqa: F401
                   register_move, register_store, sendrecv)
from .tensor_engine import nc_matmul, nc_matmul_mx, nc_transpose, quantize_mx  # noqa: F401
from .vector import (bn_aggr, bn_stats, max8, nc_find_index8, nc_match_replace8, nc_stream_shuffle,  # noqa: F401
                     reciprocal, scalar_tensor_tensor, tensor_partition_reduce, tensor_reduce, tensor_scalar,
                     tensor_scalar_cumulative, tensor_scalar_reduce, tensor_tensor, tensor_tensor_scan)

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]
