"""The house's layering: imports flow one way, with no cycle, function-level imports
included (an import inside a function is still a dependency, only a later one).

Packages: ``adaptive_eager`` -> ``adaptive_eager.fusion`` -> ``adaptive_eager_device``.
Inside the device (``device/``), layers from the bottom: the C++ extension ``_C``,
``core/``, ``memory/``, ``hardware/``, ``ops/``, then the registration and the entry
points at the top (``backend``, ``api``, ``dynamo``, the package itself), and the
compatibility packages above it (``torch_neuronx``, ``nki``). A module may import its own
layer or a lower one, never a higher one.
"""
from __future__ import annotations

import ast
import os

import networkx as nx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# source folder -> the package name it installs as (setup.cfg, package_dir)
PACKAGES = {"device": "adaptive_eager_device", "fusion": "adaptive_eager.fusion", "adaptive_eager": "adaptive_eager"}
DEVICE_LAYERS = ["_C", "core", "memory", "hardware", "ops", "<top>", "torch_neuronx", "nki"]
PACKAGE_LAYERS = ["adaptive_eager_device", "adaptive_eager.fusion", "adaptive_eager"]


def _modules() -> dict:
    """Installed module name -> source file, for every module of the three packages."""
    found = {}
    for folder, package in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for directory, subdirectories, files in os.walk(base):
            subdirectories[:] = [d for d in subdirectories if d not in ("__pycache__", "autoload", "csrc")]
            for file in files:
                if not file.endswith(".py"):
                    continue
                relative = os.path.relpath(os.path.join(directory, file), base)[:-3].split(os.sep)
                if relative[-1] == "__init__":
                    relative = relative[:-1]
                if folder == "adaptive_eager" and relative[:1] == ["fusion"]:
                    continue
                found[".".join([package, *relative])] = os.path.join(directory, file)
    return found


def _imports(name: str, path: str, modules: dict) -> set:
    """The modules of ``modules`` that ``name`` imports anywhere in its file."""
    is_package = path.endswith("__init__.py")
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # ``from package import module`` imports the module; ``from module import
            # name`` the module itself
            submodules = [f"{stem}.{alias.name}" for alias in node.names]
            submodules = [m for m in submodules if m in modules or m == "adaptive_eager_device._C"]
            candidates = submodules or [stem]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            if (candidate in modules or candidate == "adaptive_eager_device._C") and candidate != name:
                targets.add(candidate)
    return targets


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            graph.add_edge(name, target)
    return graph


def _device_layer(name: str) -> int:
    parts = name.split(".")
    if parts[0] != "adaptive_eager_device":
        return len(DEVICE_LAYERS)
    if len(parts) > 1 and parts[1] in DEVICE_LAYERS:
        return DEVICE_LAYERS.index(parts[1])
    return DEVICE_LAYERS.index("<top>")


def _package_layer(name: str) -> int:
    if name.startswith("adaptive_eager_device"):
        return 0
    return 1 if name.startswith("adaptive_eager.fusion") else 2


def upward_imports(graph) -> list:
    """Edges that go up: from a lower package or device layer to a higher one."""
    upward = []
    for source, target in graph.edges:
        if _package_layer(target) > _package_layer(source):
            upward.append((source, target))
        elif _package_layer(source) == 0 and _device_layer(target) > _device_layer(source):
            upward.append((source, target))
    return sorted(upward)


def test_no_module_imports_a_higher_layer():
    assert upward_imports(_graph()) == []


def test_no_import_cycle_function_level_imports_included():
    cycles = [sorted(component) for component in nx.strongly_connected_components(_graph()) if len(component) > 1]
    assert cycles == []


def test_the_device_folder_holds_its_entry_points_and_layers_only():
    """Each module lives in the room of its job: directly in ``device/`` only the
    registration and the shared entry points."""
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "device")) if f.endswith(".py"))
    assert top == ["__init__.py", "api.py", "backend.py", "dynamo.py"]


@pytest.mark.parametrize("edge, found", [
    (("adaptive_eager_device.core.errors", "adaptive_eager_device.ops.dispatch"), True),
    (("adaptive_eager_device.ops.views", "adaptive_eager_device.hardware.sink"), False),
    (("adaptive_eager_device.hardware.sink", "adaptive_eager.fusion.planner"), True),
    (("adaptive_eager.fusion.planner", "adaptive_eager_device.hardware.sink"), False),
])
def test_the_checker_sees_an_upward_import(edge, found):
    """The checker itself: an edge added from a lower layer to a higher one is reported."""
    graph = nx.DiGraph([edge])
    assert (list(edge) in [list(e) for e in upward_imports(graph)]) == found
