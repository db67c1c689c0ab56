"""The rule adaptive-eager's compatibility modules share: never shadow the real thing.

adaptive-eager installs two modules under other projects' import names: ``torch_neuronx``
(TorchNeuron's, ``device/torch_neuronx``) and ``nki`` (the Neuron Kernel Interface's, ``device/nki``).
Each answers only while no other installed distribution provides that name. In an editable
install (the README's) a real package anywhere on ``sys.path`` is found first anyway: setuptools'
editable finder comes after Python's path finder. Where the compatibility module is imported
anyway while another distribution provides the name, :func:`step_aside` loads the other one in its
place with a ``RuntimeWarning``, or raises ImportError when there is none to load (two
non-editable installs wrote the same folder).

This file imports nothing heavy (no torch): each shim loads it by path from the installed
``adaptive_eager_device`` folder (``importlib.util.find_spec`` locates a package without importing
it), before deciding whether to import anything else.
"""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings

PROVIDER = "adaptive-eager"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def other_providers(module_name: str, distributions: tuple[str, ...]) -> list[str]:
    """Installed distributions other than adaptive-eager that provide ``module_name``: the
    ones named in ``distributions`` (the real project's names) and any whose top-level names
    include it."""
    wanted = {_canonical(d) for d in distributions}
    found = []
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if _canonical(name) == PROVIDER:
            continue
        if _canonical(name) in wanted:
            found.append(f"{name} {dist.version}")
            continue
        top_level = (dist.read_text("top_level.txt") or "").split()
        if module_name in top_level:
            found.append(f"{name} {dist.version}")
    return found


def step_aside(module_name: str, here: str, providers: list[str], what: str) -> types.ModuleType:
    """Load the other ``module_name`` in the compatibility module's place (``sys.modules``
    then holds it), or refuse with ImportError. ``here`` is the compatibility package's folder;
    ``what`` says what it is, for the messages."""
    paths = [p for p in sys.path
             if os.path.realpath(os.path.join(p or os.getcwd(), module_name)) != os.path.realpath(here)]
    spec = importlib.machinery.PathFinder.find_spec(module_name, paths)
    if spec is None or spec.origin is None or os.path.dirname(os.path.realpath(spec.origin)) == os.path.realpath(here):
        raise ImportError(
            f"{module_name}: {', '.join(providers)} is installed, but this {module_name} is adaptive-eager's "
            f"{what} ({here}), and no other {module_name} is on sys.path (two non-editable installs wrote the "
            f"same folder). Uninstall adaptive-eager, or install it editable (pip install -e), then reinstall "
            f"{providers[0].split()[0]}.")
    warnings.warn(
        f"{module_name}: {', '.join(providers)} is installed; adaptive-eager's {what} steps "
        f"aside and loads {spec.origin} instead.", RuntimeWarning, stacklevel=3)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module

