"""Adaptive eager for the simulated ``neuron`` PyTorch device.

``import torch`` registers the ``neuron`` device through the ``torch.backends`` entry
point: it loads the device package (``adaptive_eager_device``, the repository's
``device/``) and nothing of this runtime, unless ``NEURON_ADAPTIVE_EAGER``,
``NEURON_FUSION_STATS`` or ``NEURON_LOG_LEVEL`` ask for it. ``import adaptive_eager``
loads the runtime and gives its public API:

- ``stats()``, ``reset_stats()``: the fusion-statistics dump (also written as JSON at
  exit to ``NEURON_FUSION_STATS=<path>``);
- ``enable()``, ``disable()``, ``mode(adaptive)``: switch between strict and adaptive
  eager (``NEURON_ADAPTIVE_EAGER=1`` enables adaptive eager at start-up);
- ``window_policy(**fields)``: change the adaptive window's thresholds for a region
  (``max_ops``, ``min_ops``, ``shallow_us``, ``patterns``, ``on_chip_bytes``);
  ``clear_caches()`` empties its plan and kernel caches;
- ``synchronize()``: wait for the device, rethrow deferred errors;
- ``NeuronRuntimeError``: what a deferred device error is raised as.
"""
from __future__ import annotations

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))

# torch first: `import torch` itself autoloads this package's entry point
# (device.backend.register), which must find torch fully imported, not half-way.
import torch  # noqa: E402,F401

from adaptive_eager_device import NeuronRuntimeError, PoisonedTensorError  # noqa: E402
from adaptive_eager_device.core.config import CONFIG as _CONFIG  # noqa: E402
from adaptive_eager_device.core.location import add_internal_dir as _add_internal_dir  # noqa: E402
from adaptive_eager_device.core.reasons import Flush as _Flush  # noqa: E402
from adaptive_eager_device.hardware.sink import synchronize as _synchronize  # noqa: E402
from .mode import clear_caches, disable, enable, is_enabled, mode, window_policy  # noqa: E402
from .statistics import install_exit_dump as _install_exit_dump  # noqa: E402
from .statistics import reset_stats, stats  # noqa: E402

_add_internal_dir(_here)
_install_exit_dump()
if _CONFIG.adaptive:  # NEURON_ADAPTIVE_EAGER=1
    enable()


def synchronize() -> None:
    """Wait for every kernel issued so far; rethrow the earliest deferred error."""
    _synchronize(_Flush.SYNCHRONIZE)


def inject_fault(op_name: str, nth: int = 1) -> None:
    """Fault injection for tests: the ``nth`` kernel (from now) running ``op_name``
    (``"aten::mul"`` or ``"mul"``) fails on the device. Same as ``NEURON_SIM_FAULT``."""
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    QUEUE.inject_fault(op_name, nth)


def wait_for_generated_kernels(timeout: float | None = None) -> bool:
    """Compiled mode: wait until the fused kernels being generated in the background
    (Inductor's CPU code, ``NEURON_COMPILED_INDUCTOR``) are compiled; False on a timeout.
    Their next calls run them. Benches and tests use it; programs need not."""
    from .generated import wait

    return wait(timeout)


def clear_faults() -> None:
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    QUEUE.clear_faults()


__all__ = [
    "NeuronRuntimeError", "PoisonedTensorError", "clear_caches", "clear_faults", "disable", "enable", "inject_fault",
    "is_enabled", "mode", "reset_stats", "stats", "synchronize", "wait_for_generated_kernels", "window_policy",
]

# Seeing what happened (issue 6): PyTorch/XLA-style metrics, and the silent-by-default
# `adaptive_eager` logger hierarchy (NEURON_LOG_LEVEL=DEBUG prints it to stderr).
from .logs import setup as _setup_logging  # noqa: E402
from .metrics import clear_counters, counter_names, counter_value, counters, metric_names, metric_value, metrics_report  # noqa: E402,I001

_setup_logging()
__all__ += ["clear_counters", "counter_names", "counter_value", "counters", "metric_names", "metric_value", "metrics_report"]
