"""``nki``: the Neuron Kernel Interface, answered by adaptive-eager's simulated NeuronCore-v3.

Not AWS's NKI. It follows AWS's public NKI documentation (the NKI Language Guide and the
``nki.language`` / ``nki.isa`` API reference in ``aws-neuron/aws-neuron-sdk``) so that NKI kernels
run unmodified on the CPU::

    import nki
    import nki.language as nl
    import nki.isa as nisa

    @nki.jit
    def add(a, b):
        ta = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf); nisa.dma_copy(dst=ta, src=a)
        tb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf); nisa.dma_copy(dst=tb, src=b)
        nisa.tensor_tensor(dst=ta, data1=ta, data2=tb, op=nl.add)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm); nisa.dma_copy(dst=out, src=ta)
        return out

    c = nki.simulate(add)(a_np, b_np)          # as the SDK's CPU simulator
    c, trace, time_us = nki.run(add, a_np, b_np)  # plus the instruction trace and simulated time

What it checks, beyond the SDK simulator: SBUF and PSUM capacity of one NeuronCore-v3 (see
``nki.cost.FIGURES``). What a kernel costs: ``nki.cost``.

setup.cfg installs this folder (``device/nki``) under the top-level name ``nki``. It never
shadows a real NKI: in an editable install a real ``nki`` on ``sys.path`` is found first; where
this module is imported anyway while another distribution (``pip install nki``) provides
``nki``, it steps aside with a ``RuntimeWarning`` and loads the other one, or raises ImportError
when there is none to load (``device/core/compat_names.py``, the rule ``torch_neuronx`` follows too).
"""
from __future__ import annotations

import importlib.util
import os
import sys


def _compat_names():
    """device/core/compat_names.py, loaded by path from the installed adaptive_eager_device package
    without importing that package (it imports torch)."""
    spec = importlib.util.find_spec("adaptive_eager_device")
    path = os.path.join(list(spec.submodule_search_locations)[0], "core", "compat_names.py")
    file_spec = importlib.util.spec_from_file_location("_adaptive_eager_compat_names", path)
    module = sys.modules.get(file_spec.name)
    if module is None:
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = module
        file_spec.loader.exec_module(module)
    return module


#: This is the simulated NKI, not AWS's.
SIMULATED = True
_HERE = os.path.dirname(os.path.abspath(__file__))
_COMPAT = _compat_names()
_providers = _COMPAT.other_providers("nki", ("nki",))

if _providers:
    _COMPAT.step_aside("nki", _HERE, _providers, "simulated NKI")
else:
    import numpy as _np

    from . import collectives, cost, isa, language  # noqa: F401
    from ._state import Instruction, NkiValidationError  # noqa: F401
    from .runtime import Kernel, RunResult, jit, run, simulate  # noqa: F401
    from .tensor import NkiTensor  # noqa: F401

    dtype = _np.dtype  # annotation type of NKI dtypes (``nki.dtype``)
    __version__ = "0.4.0+adaptive.eager"

    __all__ = ["jit", "simulate", "run", "Kernel", "RunResult", "Instruction", "NkiTensor", "NkiValidationError",
               "language", "isa", "cost", "collectives", "dtype", "SIMULATED"]
