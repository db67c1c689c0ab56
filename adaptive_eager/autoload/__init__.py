"""The runtime's own ``torch.backends`` entry point: with ``import torch`` alone, the
adaptive runtime loads when the environment asks for it, and not otherwise.

Installed as the top-level package ``adaptive_eager_autoload`` (``setup.cfg``), so that
PyTorch loading this hook imports nothing of the runtime until :func:`load` decides to:
``import adaptive_eager`` is the runtime (adaptive eager, the statistics dump at exit,
logging). The device registers through its own entry point
(``adaptive_eager_device.backend:register``) and never imports the runtime, so imports
flow one way: adaptive_eager -> fusion -> device.

The variables that ask: ``NEURON_ADAPTIVE_EAGER`` (adaptive eager on from the start),
``NEURON_FUSION_STATS`` (a statistics dump at exit) and ``NEURON_LOG_LEVEL`` (the
runtime's loggers), as ``device/core/config.py`` parses them. A failure here must not break
``import torch``: it is reported as a warning, and the device still works.
"""
from __future__ import annotations


def load() -> None:
    try:
        from adaptive_eager_device.core.config import CONFIG

        if CONFIG.adaptive or CONFIG.stats_path or CONFIG.log_level is not None:
            import adaptive_eager  # noqa: F401
    except Exception as error:  # noqa: BLE001 - never break `import torch`
        import warnings

        warnings.warn(f"the neuron adaptive runtime did not load at `import torch`: {error!r}; "
                      "`import adaptive_eager` loads it", stacklevel=2)
