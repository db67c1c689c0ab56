"""``torch_neuronx``: TorchNeuron's import name, answered by adaptive-eager's simulated device.

Not TorchNeuron. The Hugging Face libraries detect TorchNeuron by looking for this
module: transformers' ``is_torch_neuron_available`` and accelerate's
``is_neuron_available`` call ``importlib.util.find_spec("torch_neuronx")``, then
``torch.neuron.is_available()``; Trainer (``TrainingArguments.device``), Accelerate
(``Accelerator().device``), TRL (``SFTConfig``'s bf16 default) and Trainer's
``torch_compile_backend`` ("neuron") follow from that. Everything they call after
the probe is on ``torch.neuron`` (``device/api.py``): ``is_available``,
``device_count``, ``current_device``, ``set_device``, ``is_bf16_supported``,
``get_device_properties``, ``manual_seed_all``, the RNG states, the memory queries,
``empty_cache``. This module exists so the probe finds something, and registers the
device when imported (also with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).

setup.cfg installs this folder (``device/torch_neuronx``) under the top-level name
``torch_neuronx``. ``import torch`` does not load it.

It never shadows a real TorchNeuron. In an editable install (the README's), a
``torch_neuronx`` anywhere on ``sys.path`` is found before this one: setuptools'
editable finder comes after Python's path finder. Where this module is imported anyway
while another distribution (``pip install torch-neuronx``) provides ``torch_neuronx``,
it steps aside loudly: a ``RuntimeWarning`` says so, and the other ``torch_neuronx``
found on ``sys.path`` is loaded in its place; if there is none (a non-editable install
of both packages writes the same folder), ``import torch_neuronx`` raises ImportError
saying which distributions clash.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys


def _compat_names():
    """device/core/compat_names.py (the step-aside rule this module shares with ``nki``), loaded by path
    from the installed adaptive_eager_device package without importing that package."""
    spec = importlib.util.find_spec("adaptive_eager_device")
    path = os.path.join(list(spec.submodule_search_locations)[0], "core", "compat_names.py")
    file_spec = importlib.util.spec_from_file_location("_adaptive_eager_compat_names", path)
    module = sys.modules.get(file_spec.name)
    if module is None:
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = module
        file_spec.loader.exec_module(module)
    return module


#: This is the compatibility module, not TorchNeuron.
SIMULATED = True
PROVIDER = "adaptive-eager"

_HERE = os.path.dirname(os.path.abspath(__file__))
_COMPAT = _compat_names()

_providers = _COMPAT.other_providers("torch_neuronx", ("torch-neuronx",))
if _providers:
    _COMPAT.step_aside("torch_neuronx", _HERE, _providers, "compatibility module for its simulated device")
else:
    import torch
    from adaptive_eager_device import register as _register

    _register()  # what importing TorchNeuron does: the device is there afterwards

    try:
        __version__ = importlib.metadata.version(PROVIDER) + "+adaptive.eager"
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        __version__ = "0+adaptive.eager"

    def is_available() -> bool:
        return torch.neuron.is_available()

    def device_count() -> int:
        return torch.neuron.device_count()

    def current_device() -> int:
        return torch.neuron.current_device()

    from ._nki_op import nki_op  # noqa: F401  (TorchNeuron's way to register an NKI kernel as an op)

    def __getattr__(name: str):
        if name == "nki":  # TorchNeuron imports NKI when it loads; here on first use
            import nki

            return nki
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"torch_neuronx.{name}: this torch_neuronx is adaptive-eager's compatibility module for the "
            "simulated neuron device (it lets libraries detect the device as TorchNeuron), not TorchNeuron; "
            "it has no such attribute. Use torch.neuron and the `neuron` device.")
