"""pytest plugin that :mod:`bench.torch_suites` loads (``-p bench.torch_suites_shim``) into
every pytest process it runs on PyTorch's upstream test files.

It does five things, all driven by environment variables the runner sets:

1. **Compatibility.** The upstream test files are older than the installed torch
   (see the runner's docstring for the version). A few names they import were dropped
   from ``torch.testing._internal`` since; :data:`RESTORED` puts them back with the
   meaning they had (each documented below). A test name the old files define twice
   is instantiated once instead of failing the file's collection
   (:func:`_tolerate_redefinitions`). Nothing else in torch is changed.
2. **The device.** For a neuron run (``TORCH_SUITES_DEVICE=neuron``) it imports
   ``adaptive_eager`` (which registers ``neuron`` as the PrivateUse1 backend) before
   the test module is collected, and sets ``PrivateUse1TestBase.device_type`` to the
   backend's name, so ``instantiate_device_type_tests`` names the classes
   ``...NEURON``; PyTorch itself does that in ``setUpClass`` of the first class, which
   is after collection, so without it a file's classes would be named
   ``...PRIVATEUSE1``. The mode (strict or adaptive eager) comes from
   ``NEURON_ADAPTIVE_EAGER``, which ``adaptive_eager`` reads at import.
3. **Which tests.** Only items of classes named ``*<SUFFIX>`` (``TORCH_SUITES_SUFFIX``:
   ``NEURON`` or ``CPU``) are kept: the classes instantiated for the device under test.
   Node ids listed in ``TORCH_SUITES_DONE`` (one a line) are deselected: a resumed
   process skips the tests an earlier, crashed process finished.
4. **What happened.** Every test's start and every report is appended, flushed, to
   ``TORCH_SUITES_LOG`` as one JSON line: ``{"start": nodeid}`` when a test starts,
   ``{"nodeid", "when", "outcome", "message", "seconds"}`` per report. A process that
   dies mid-test leaves a start line without a final report: the runner reports that
   test as a crash.
5. **Isolation.** On neuron, each test ends with a sync point (``torch.neuron.synchronize()``
   in its teardown), so a deferred device error (a kernel that failed on the queue, which
   surfaces at the next sync point by design) is reported against the test that issued
   it, as a teardown error, and not against whichever later test happens to sync first.
   It never turns a failure into a pass: it only moves an error to its own test.
"""
from __future__ import annotations

import json
import os

import pytest

DEVICE = os.environ.get("TORCH_SUITES_DEVICE", "")
SUFFIX = os.environ.get("TORCH_SUITES_SUFFIX", "")
LOG = os.environ.get("TORCH_SUITES_LOG", "")
DONE = os.environ.get("TORCH_SUITES_DONE", "")


def _identity(fn):
    return fn


def _restore_names() -> list:
    """Put back the names the upstream files import that this torch no longer has; return
    the ``module.name`` of each one restored."""
    import torch.testing._internal.common_cuda as common_cuda
    import torch.testing._internal.common_nn as common_nn
    import torch.testing._internal.common_utils as common_utils

    restored = []
    candidates = {
        # Skipped a test on Apple's MPS backend; no MPS here, so it never skips.
        (common_utils, "skipIfMps"): _identity,
        # "TF32 changes float32 matmul precision": only ever true on CUDA Ampere+.
        (common_cuda, "tf32_is_not_fp32"): lambda: False,
        # The old-style module test dicts test_nn.py turns into TestNN (CPU/CUDA, not
        # device-generic) tests; they became ModuleInfos (bench/module_coverage.py runs
        # those on neuron). Empty: no TestNN tests are generated from it.
        (common_nn, "new_module_tests"): [],
    }
    for (module, name), value in candidates.items():
        if not hasattr(module, name):
            setattr(module, name, value)
            restored.append(f"{module.__name__}.{name}")
    return restored


RESTORED = _restore_names()
DROPPED: list = []  # duplicate test names not instantiated (see _tolerate_redefinitions)


def _tolerate_redefinitions() -> None:
    """A test the old files define twice under one instantiated name (test_nn.py has
    ``test_activations_bfloat16_cpu`` and ``test_activations_bfloat16``, which this torch
    names alike on the CPU) aborts the whole file's collection with "Redefinition of
    test"; keep the first definition and drop the second instead (listed in DROPPED)."""
    from torch.testing._internal.common_device_type import DeviceTypeTestBase

    original = DeviceTypeTestBase.instantiate_test.__func__

    def instantiate_test(cls, name, test, *, generic_cls=None):
        try:
            original(cls, name, test, generic_cls=generic_cls)
        except AssertionError as exc:
            if "Redefinition of test" not in str(exc):
                raise
            DROPPED.append(f"{cls.__name__}.{name}: {exc}")

    DeviceTypeTestBase.instantiate_test = classmethod(instantiate_test)


_tolerate_redefinitions()


def _setup_device() -> None:
    if DEVICE != "neuron":
        return
    import torch
    import torch.testing._internal.common_device_type as common_device_type

    import adaptive_eager  # noqa: F401 - registers the neuron backend (PrivateUse1)

    common_device_type.PrivateUse1TestBase.device_type = torch._C._get_privateuse1_backend_name()


_setup_device()


def _write(record: dict) -> None:
    if not LOG:
        return
    with open(LOG, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _done() -> set:
    if not DONE or not os.path.exists(DONE):
        return set()
    with open(DONE) as handle:
        return {line.strip() for line in handle if line.strip()}


def pytest_collection_modifyitems(config, items):
    done = _done()
    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        ours = cls is not None and (not SUFFIX or cls.__name__.endswith(SUFFIX))
        (keep if ours and item.nodeid not in done else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    _write({"start": nodeid})


def _message(report) -> str:
    if report.outcome == "skipped":
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            return str(longrepr[2])[:300]
        return str(getattr(report, "wasxfail", "") or longrepr)[:300]
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            return str(crash.message).strip()[:500]
        return str(report.longrepr).strip().splitlines()[-1][:500] if report.longrepr else ""
    return ""


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                "xfail": bool(getattr(report, "wasxfail", None) is not None),
                "message": _message(report), "seconds": round(report.duration, 3)})


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if DEVICE == "neuron":
        import torch

        torch.neuron.synchronize()  # raises the test's own deferred device error, if any


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    _write({"finish": nodeid})
