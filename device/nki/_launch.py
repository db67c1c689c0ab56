"""Running a kernel's programs: ``launch`` (one thread per SPMD program, sharing HBM), and the
kernels' numbers (``kernel_key``).

Shared by ``nki.simulate``/``nki.run`` (``runtime.py``, which convert numpy arrays first) and the
device's custom-kernel path (``_torch.py``, which converts the storages' bytes).
"""
from __future__ import annotations

import math
import threading

import numpy as np

from ._state import NkiValidationError, Program, Shared, set_current, trim_traceback


KERNELS: list = []  # a kernel's key -> the kernel (the first with its function and grid)
_KEYS: dict = {}  # (function, grid) -> key


def kernel_key(kernel) -> int:
    """A number for ``kernel``'s function and launch grid (``Kernel.key``)."""
    identity = (kernel.fn, kernel.grid)
    key = _KEYS.get(identity)
    if key is None:
        key = _KEYS[identity] = len(KERNELS)
        KERNELS.append(kernel)
    return key


def launch(kernel, args, kwargs):
    """Run ``kernel``'s programs on arguments already converted (HBM ``NkiTensor`` objects and plain
    values); returns ``(the first program's result, programs)``. A failure is re-raised in the
    caller's thread. The device's custom-kernel path (``nki._torch``) calls this directly."""
    grid = kernel.grid
    nprograms = math.prod(grid) if grid else 1
    shared = Shared(nprograms)
    programs = []
    for index in range(nprograms):
        pid = tuple(int(x) for x in np.unravel_index(index, grid)) if grid else ()
        programs.append(Program(kernel.name, grid, pid, shared, index))
    results = [None] * nprograms
    errors = [None] * nprograms

    def body(index):
        previous = set_current(programs[index])
        try:
            results[index] = kernel.fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors[index] = error
            if shared.barrier is not None:
                shared.barrier.abort()
        finally:
            programs[index].active = False
            set_current(previous)

    if nprograms == 1:
        body(0)
    else:
        threads = [threading.Thread(target=body, args=(i,), name=f"nki-{kernel.name}-{i}") for i in range(nprograms)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    failure = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    failure = failure or next((e for e in errors if e is not None), None)
    if failure is not None:
        if isinstance(failure, NkiValidationError):
            trim_traceback(failure)
        raise failure
    return results[0], programs
