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

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import warnings

#: This is the compatibility module, not TorchNeuron.
SIMULATED = True
PROVIDER = "adaptive-eager"

_HERE = os.path.dirname(os.path.abspath(__file__))


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _other_providers() -> list[str]:
    """Installed distributions other than adaptive-eager that provide ``torch_neuronx``:
    the one named ``torch-neuronx`` (TorchNeuron's), and any whose files or top-level
    names include it."""
    found = []
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if _canonical(name) == PROVIDER:
            continue
        if _canonical(name) == "torch-neuronx":
            found.append(f"{name} {dist.version}")
            continue
        top_level = (dist.read_text("top_level.txt") or "").split()
        if "torch_neuronx" in top_level:
            found.append(f"{name} {dist.version}")
    return found


def _step_aside(providers: list[str]) -> None:
    """Load the other ``torch_neuronx`` in this module's place, or refuse."""
    paths = [p for p in sys.path
             if os.path.realpath(os.path.join(p or os.getcwd(), "torch_neuronx")) != os.path.realpath(_HERE)]
    spec = importlib.machinery.PathFinder.find_spec("torch_neuronx", paths)
    if spec is None or spec.origin is None or os.path.dirname(os.path.realpath(spec.origin)) == os.path.realpath(_HERE):
        raise ImportError(
            f"torch_neuronx: {', '.join(providers)} is installed, but this torch_neuronx is adaptive-eager's "
            f"compatibility module for its simulated device ({_HERE}), not TorchNeuron, and no other "
            "torch_neuronx is on sys.path (two non-editable installs wrote the same folder). Uninstall "
            "adaptive-eager, or install it editable (pip install -e), then reinstall torch-neuronx.")
    warnings.warn(
        f"torch_neuronx: {', '.join(providers)} is installed; adaptive-eager's compatibility module steps "
        f"aside and loads {spec.origin} instead.", RuntimeWarning, stacklevel=3)
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


_providers = _other_providers()
if _providers:
    _step_aside(_providers)
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

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"torch_neuronx.{name}: this torch_neuronx is adaptive-eager's compatibility module for the "
            "simulated neuron device (it lets libraries detect the device as TorchNeuron), not TorchNeuron; "
            "it has no such attribute. Use torch.neuron and the `neuron` device.")
