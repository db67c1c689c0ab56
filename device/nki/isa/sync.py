"""Registers, barriers, send/receive between the programs of an LNC2 launch, the target version."""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from ..tensor import private_hbm, sbuf, shared_hbm
from .constants import dma_engine, engine, nc_version
from ._call import _Call, VirtualRegister


def register_alloc(x=None):
    """A virtual register, optionally initialised with an integer."""
    c = _Call("register_alloc")
    reg = VirtualRegister(x)
    c.record("Sync")
    return reg


def register_move(dst, src):
    c = _Call("register_move")
    if not isinstance(dst, VirtualRegister) or dst.frozen:
        c.fail("dst must be a writable VirtualRegister")
    dst.value = int(src.value if isinstance(src, VirtualRegister) else src)
    return c.record("Sync")


def register_load(dst, src):
    """Load a one-element SBUF/HBM tensor into a register."""
    c = _Call("register_load")
    if not isinstance(dst, VirtualRegister) or dst.frozen:
        c.fail("dst must be a writable VirtualRegister")
    c.tile("src", src, (sbuf, private_hbm, shared_hbm))
    if src.size != 1:
        c.fail(f"src must hold exactly one element, got shape {src.shape}")
    value = np.asarray(src.read(c.name)).reshape(-1)[0]
    dst.value = int(value)
    return c.record("Sync")


def register_store(dst, src):
    c = _Call("register_store")
    c.tile("dst", dst, (sbuf, private_hbm, shared_hbm), write=True)
    if dst.size != 1:
        c.fail(f"dst must hold exactly one element, got shape {dst.shape}")
    dst.write(np.full(dst.shape, int(src.value if isinstance(src, VirtualRegister) else src), dtype=np.int64), c.name)
    return c.record("Sync")


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Wait until every core of the launch reaches this barrier (LNC2)."""
    c = _Call("core_barrier")
    shared = c.program.shared
    if shared.barrier is not None:
        shared.barrier.wait()
    return c.record(c.engine(engine, "GpSimd", ("GpSimd", "VectorE", "ScalarE", "TensorE", "Sync")))


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None):
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving ``recv_from_rank``'s ``src``."""
    c = _Call("sendrecv")
    c.tile("src", src, (sbuf,))
    c.tile("dst", dst, (sbuf,), write=True)
    if src.dtype != dst.dtype or src.shape != dst.shape:
        c.fail(f"src and dst must have the same dtype and shape ({src.shape} {_dtypes.name(src.dtype)}, "
               f"{dst.shape} {_dtypes.name(dst.dtype)})")
    shared = c.program.shared
    me = c.program.index
    if shared.nprograms == 1:
        if int(send_to_rank) != 0 or int(recv_from_rank) != 0:
            c.fail("sendrecv needs an LNC2 launch (kernel[2]) to reach another core")
        c.write(dst, c.read(src, f32=False))
    else:
        payload = np.array(src.read(c.name), copy=True)
        with shared.cond:
            shared.pipes.setdefault((int(pipe_id), me, int(send_to_rank)), []).append(payload)
            shared.cond.notify_all()
            key = (int(pipe_id), int(recv_from_rank), me)
            if not shared.cond.wait_for(lambda: shared.pipes.get(key), timeout=60):
                c.fail(f"sendrecv: nothing received from core {recv_from_rank} on pipe {pipe_id} (deadlock)")
            received = shared.pipes[key].pop(0)
        dst.write(received, c.name)
    return c.record("DMA", nbytes=src.size * src.itemsize, rows=src.shape[0])


def get_nc_version():
    """The simulated target: NeuronCore-v3 (Trn2)."""
    return nc_version.gen3


def get_nc_sub_version():
    return 0
