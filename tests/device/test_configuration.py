"""Bad input gets one clear line: ``NEURON_*`` values, device ordinals, the blocking hint.

Every ``NEURON_*`` variable is parsed in one place (``device/core/config.py``). A bad value
never breaks ``import torch``, nor a program that never uses the device; the device's
first use raises one line that names the variable, the value and what is allowed.
"""
import os
import subprocess
import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager_device.core.config import VARIABLES, DeviceConfig

PROGRAM = """
import torch
print("cpu", torch.ones(2).sum().item())
torch.manual_seed(0)
try:
    torch.ones(2, device="neuron")
except ValueError as error:
    print("device:", error)
else:
    print("device: works")
"""


def run(env_update, code=PROGRAM):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
    env.update(env_update)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


BAD = [
    ("NEURON_ADAPTIVE_EAGER", "banana", "expected 1 or 0"),
    ("NEURON_ADAPTIVE_EAGER", "flase", "expected 1 or 0"),
    ("NEURON_ADAPTIVE_WINDOW", "0", "expected a number >= 1"),
    ("NEURON_ADAPTIVE_MIN_WINDOW", "-4", "expected a number >= 1"),
    ("NEURON_ADAPTIVE_WINDOW", "12.5", "expected an integer"),
    ("NEURON_SIM_HBM_GB", "-1", "expected a number > 0"),
    ("NEURON_SIM_HBM_GB", "abc", "expected a number"),
    ("NEURON_FALLBACK", "banana", "expected 1 or 0"),
    ("NEURON_SIM_FAULT", "mul", "expected op:n"),
    ("NEURON_LOG_LEVEL", "LOUD", "expected DEBUG, INFO"),
    ("NEURON_ADAPTIVE_ON_CHIP_MB", "-3", "expected a number >= 0"),
    ("NEURON_SIM_LNC", "4", "expected 1 or 2"),
    ("NEURON_ADAPTIVE_POLICY", "xla", "expected ours or torchneuron"),
]


def _groups(cases):
    """The cases in as few environments as hold each variable once: one fresh process per
    environment (starting Python and importing torch is most of a case's cost), every
    bad value of it present at once."""
    groups = []
    for variable, value, _ in cases:
        group = next((g for g in groups if variable not in g), None)
        if group is None:
            groups.append(group := {})
        group[variable] = value
    return groups


@pytest.fixture(scope="module")
def bad_environments():
    """{(variable, value): the run of PROGRAM in the environment that holds that bad value}."""
    runs = {}
    for group in _groups(BAD):
        result = run(group)
        runs.update({(variable, value): result for variable, value in group.items()})
    return runs


def test_each_environment_holds_each_variable_once():
    groups = _groups(BAD)
    assert sorted((v, x) for g in groups for v, x in g.items()) == sorted((v, x) for v, x, _ in BAD)
    assert len(groups) == 2  # NEURON_ADAPTIVE_EAGER, _WINDOW and NEURON_SIM_HBM_GB have two bad values each


@pytest.mark.parametrize("variable, value, allowed", BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_a_bad_value_keeps_import_torch_and_fails_the_first_device_use_in_one_line(variable, value, allowed,
                                                                                    bad_environments):
    """Each bad value, with the other variables of its environment also bad: import torch
    and CPU code are untouched, and the first device use raises one line naming every bad
    value (``CONFIG.problem()`` joins them), this one among them."""
    result = bad_environments[(variable, value)]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "cpu 2.0"  # import torch and CPU code are untouched
    assert lines[1].startswith("device: ") and len(lines) == 2
    assert f"{variable}={value!r} is not valid: {allowed}" in lines[1]
    assert result.stderr == ""


@pytest.mark.parametrize("variable, value, allowed", BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_a_bad_value_alone_is_the_whole_message(variable, value, allowed):
    """The message of one bad value alone (in-process: the same parser the device's import
    runs): nothing but its own line, and the settings keep their defaults."""
    config, defaults = DeviceConfig({variable: value}), DeviceConfig({})
    assert len(config.errors) == 1 and config.errors[0].startswith(f"{variable}={value!r} is not valid: {allowed}")
    assert config.problem() == config.errors[0] + " (the neuron device reads NEURON_* variables at import)"
    # a bad value changes no setting: what the device's import reads is the defaults, as in
    # an environment without it (so the bad values of one process cannot hide each other)
    for _, attribute, _, _, _ in VARIABLES:
        assert getattr(config, attribute) == getattr(defaults, attribute), attribute


def test_fault_injection_from_the_environment():
    """NEURON_SIM_FAULT=op:n (a valid value) injects a deferred device error at the nth
    kernel running op, raised at the next sync point as adaptive_eager.inject_fault does
    (tests/device/test_deferred_errors.py tests the error itself, in both modes)."""
    code = (
        "import torch, adaptive_eager\n"
        "x = torch.ones(2, device='neuron')\n"
        "y = x + 1\n"
        "try:\n"
        "    y.cpu()\n"
        "except adaptive_eager.NeuronRuntimeError as error:\n"
        "    print('raised', error.op_name)\n"
    )
    out = run({"NEURON_SIM_FAULT": "aten::add:1"}, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised aten::add"


def test_valid_values_of_every_kind_parse():
    config = DeviceConfig({
        "NEURON_ADAPTIVE_EAGER": "Yes", "NEURON_ADAPTIVE_WINDOW": "64", "NEURON_SIM_HBM_GB": "0.5",
        "NEURON_SIM_FAULT": "mul:3, aten::add:1", "NEURON_LOG_LEVEL": "debug", "NEURON_FALLBACK": "off",
    })
    assert config.errors == []
    assert (config.adaptive, config.window_ops, config.hbm_bytes, config.fallback) == (True, 64, 1 << 29, False)
    assert config.faults == (("aten::mul", 3), ("aten::add", 1))
    assert config.log_level == 10
    defaults = DeviceConfig({})
    assert defaults.errors == [] and defaults.window_ops == 128 and defaults.adaptive is False
    # one logical NeuronCore of Trn2 (LNC=2), its HBM share; LNC=1 halves it
    assert (defaults.lnc, defaults.hbm_bytes, defaults.adaptive_policy) == (2, 24 << 30, "ours")
    one = DeviceConfig({"NEURON_SIM_LNC": "1", "NEURON_ADAPTIVE_POLICY": "TorchNeuron"})
    assert (one.errors, one.lnc, one.hbm_bytes, one.adaptive_policy) == ([], 1, 12 << 30, "torchneuron")


def test_every_variable_is_in_the_readme():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    for variable, *_ in VARIABLES:
        assert f"`{variable}" in readme, variable


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("make", [
    lambda: torch.ones(2, device="neuron:1"),
    lambda: torch.empty(3, device="neuron:1"),
    lambda: torch.ones(2).to("neuron:5"),
    lambda: torch.ones(2, device="neuron").to("neuron:2"),
    lambda: torch.zeros(2, device=torch.device("neuron", 3)),
], ids=["factory", "empty", "upload", "device_to_device", "torch_device"])
def test_a_device_ordinal_past_the_count_raises_as_cuda_does(make):
    with pytest.raises(RuntimeError, match=r"invalid device ordinal: neuron:\d does not exist; the neuron device count is 1"):
        make()


@pytest.mark.usefixtures("any_mode")
def test_the_blocking_hint_is_only_given_when_blocking_is_off():
    from adaptive_eager_device.core.config import CONFIG

    bad = lambda: torch.randn(3).to("neuron").index_select(0, torch.tensor([7]).to("neuron"))  # noqa: E731
    bad()
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as deferred:
        torch.neuron.synchronize()
    assert "Set NEURON_LAUNCH_BLOCKING=1" in str(deferred.value)
    CONFIG.launch_blocking = True
    with pytest.raises(adaptive_eager.NeuronRuntimeError) as blocking:
        bad()
    assert "NEURON_LAUNCH_BLOCKING" not in str(blocking.value)
