"""The device is registered the way PyTorch expects an out-of-tree accelerator to be."""
import os
import subprocess
import sys

import pytest

import torch


def clean_environment() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}


# `import torch` alone, then one device tensor, in a fresh process: what it is, which packages
# of the repository it loaded, and the exit hooks it installed. A module fixture runs it once
# for the tests that read it (starting Python and importing torch is most of their cost).
IMPORT_TORCH = ("import sys, atexit, torch\n"
                "x = torch.ones(2, device='neuron')\n"
                "print(type(x).__name__, x.device)\n"
                "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('adaptive_eager')}))\n"
                "print('networkx' in sys.modules, atexit._ncallbacks())")


@pytest.fixture(scope="module")
def import_torch_alone():
    """The lines IMPORT_TORCH prints, without NEURON_* variables, outside the checkout."""
    return subprocess.run([sys.executable, "-c", IMPORT_TORCH], env=clean_environment(), capture_output=True,
                          text=True, check=True, cwd="/").stdout.splitlines()


def test_import_torch_alone_registers_neuron(import_torch_alone):
    # PyTorch's autoload convention: the torch.backends entry point runs on `import torch`.
    assert import_torch_alone[0].split() == ["Tensor", "neuron:0"]  # a plain tensor of the device


def test_import_torch_loads_the_device_package_alone(import_torch_alone):
    """``import torch`` (the autoload entry points) loads adaptive_eager_device and the
    runtime's 30-line hook (adaptive_eager_autoload), nothing of the adaptive runtime, the
    planner, the CLI formatters or networkx, and installs no exit hook; the runtime loads
    with ``import adaptive_eager``, or when the environment asks for it (the hook)."""
    env = clean_environment()
    baseline = subprocess.run([sys.executable, "-c", "import atexit; print(atexit._ncallbacks())"], env=env,
                              capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    assert import_torch_alone[1] == "['adaptive_eager_autoload', 'adaptive_eager_device']"
    networkx, callbacks = import_torch_alone[2].split()
    assert networkx == "False"
    # torch's own exit callbacks, plus the queue drain only (no statistics dump)
    assert int(callbacks) <= int(baseline) + 8
    on = subprocess.run([sys.executable, "-c", IMPORT_TORCH], env=dict(env, NEURON_ADAPTIVE_EAGER="1"),
                        capture_output=True, text=True, check=True, cwd="/").stdout.splitlines()
    assert on[1] == "['adaptive_eager', 'adaptive_eager_autoload', 'adaptive_eager_device']"


def test_device_strings():
    assert torch.device("neuron").type == "neuron"
    assert torch.device("neuron:0").index == 0
    assert torch.ones(1, device="neuron:0").device == torch.device("neuron", 0)


def test_torch_neuron_module_mirrors_cuda_names():
    for name in ["is_available", "device_count", "current_device", "set_device", "synchronize",
                 "manual_seed", "manual_seed_all", "seed", "get_rng_state", "set_rng_state",
                 "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"]:
        assert callable(getattr(torch.neuron, name)), name
    assert torch.neuron.is_available() and torch.neuron.device_count() == 1
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(0)
    torch.neuron.set_device("neuron:0")


def test_set_device_rejects_missing_index():
    import pytest

    with pytest.raises(RuntimeError, match="device count is 1"):
        torch.neuron.set_device(1)


def test_accelerator_interface():
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 1
    x = torch.ones(3, device="neuron") * 2
    torch.accelerator.synchronize()
    assert x.sum().item() == 6.0


def test_tensor_and_module_helpers():
    t = torch.arange(4.0)
    assert t.neuron().device.type == "neuron"
    assert t.to("neuron").is_neuron
    module = torch.nn.Linear(2, 3).neuron()
    assert module.weight.device.type == "neuron"
    assert isinstance(module.weight, torch.nn.Parameter)


def test_no_import_changes_the_public_api():
    """Importing any submodule of adaptive_eager (``adaptive_eager.stats``, the CLI, shares
    its name with the function ``stats()``) leaves every public name callable as before."""
    import importlib
    import pkgutil

    import adaptive_eager

    import adaptive_eager_device
    import adaptive_eager.fusion

    before = {name: getattr(adaptive_eager, name) for name in adaptive_eager.__all__}
    for package in (adaptive_eager, adaptive_eager_device, adaptive_eager.fusion):
        for module in pkgutil.iter_modules(package.__path__[:1]):
            if module.name != "__main__" and not module.ispkg:
                importlib.import_module(f"{package.__name__}.{module.name}")
    for name, value in before.items():
        now = getattr(adaptive_eager, name)
        assert now is value or (callable(now) and callable(value)), name
    assert adaptive_eager.stats()["mode"] in ("strict", "adaptive")
    assert adaptive_eager.stats() == adaptive_eager.statistics.stats()


def test_the_device_runs_fused_kernels_without_the_planner():
    """The fused-kernel executor is device code: importing it loads nothing of the
    runtime or the planner (imports flow adaptive_eager -> fusion -> device), so
    adaptive_eager_device still imports alone."""
    code = ("import sys, adaptive_eager_device.hardware.fused_kernel\n"
            "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('adaptive_eager')}),"
            " 'networkx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env=clean_environment())
    # (importing torch runs both autoload hooks: the device's, and the runtime's, which
    # loads nothing more unless the environment asks)
    assert out.stdout.split() == ["['adaptive_eager_autoload',", "'adaptive_eager_device']", "False"]


@pytest.mark.parametrize("first", ["import adaptive_eager", "import adaptive_eager_device",
                                   "import adaptive_eager.fusion.planner"])
def test_any_package_may_be_imported_first(first):
    """(``import torch`` first: test_import_torch_alone_registers_neuron.)"""
    code = f"{first}\nimport torch\nprint(torch.ones(1, device='neuron').device)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "neuron:0"
