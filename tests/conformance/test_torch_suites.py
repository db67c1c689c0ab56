"""bench/torch_suites.py's runner on a tiny generated test file (the upstream files are not
part of this repository): classes instantiated for ``neuron`` only, a process that aborts
or segfaults is resumed without the finished tests, and the test it died in is a crash."""
from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import torch_suites  # noqa: E402

FAKE = '''
import ctypes, os, unittest
import torch
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.common_device_type import instantiate_device_type_tests

class TestFake(TestCase):
    def test_a_pass(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 2)
    def test_b_abort(self, device):
        os.abort()
    def test_c_fail(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 3)
    def test_d_segv(self, device):
        ctypes.string_at(0)
    def test_e_pass(self, device):
        self.assertEqual(torch.zeros(1, device=device).device.type, "neuron")
    @unittest.skip("skipped")
    def test_f_skip(self, device):
        pass

class TestNotDeviceGeneric(TestCase):
    def test_x(self):
        pass

instantiate_device_type_tests(TestFake, globals())
'''


def _run_generated_file(tmp_path, name: str, source: str):
    """The runner on one generated test file, in strict eager: its record, and each test's
    outcome by its short name."""
    test_dir = tmp_path / "test"
    test_dir.mkdir()
    (test_dir / name).write_text(source)
    record = torch_suites.run_file(str(test_dir), name, "strict", str(tmp_path), test_timeout=60,
                                   process_timeout=300, echo=lambda *a: None)
    return record, {nodeid.split("::")[-1]: outcome for nodeid, (outcome, _) in record["tests"].items()}


@pytest.mark.slow  # three pytest processes that each import torch: ~20 s idle, a minute on a loaded machine
def test_crashes_are_resumed_and_reported(tmp_path):
    record, outcomes = _run_generated_file(tmp_path, "test_fake.py", FAKE)
    assert outcomes == {"test_a_pass_neuron": "pass", "test_b_abort_neuron": "crash", "test_c_fail_neuron": "fail",
                        "test_d_segv_neuron": "crash", "test_e_pass_neuron": "pass", "test_f_skip_neuron": "skip"}
    assert record["processes"] == 3  # one start, one resume after each crash
    messages = {nodeid.split("::")[-1]: message for nodeid, (_, message) in record["tests"].items()}
    assert "SIGABRT" in messages["test_b_abort_neuron"] and "SIGSEGV" in messages["test_d_segv_neuron"]
    classes = torch_suites.class_counts({"test_fake.py": record}, "neuron")
    assert classes == {"TestFake": {"run": 6, "pass": 2, "crash": 2, "fail": 1, "skip": 1}}


DEFERRING = '''
import torch
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.common_device_type import instantiate_device_type_tests

class TestDeferred(TestCase):
    def test_a_leaves_a_failed_kernel(self, device):
        x = torch.zeros(3, device=device)
        x[torch.tensor([5], device=device)] = 1.0  # out of range: fails on the queue, no sync here
    def test_b_syncs(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 2)

instantiate_device_type_tests(TestDeferred, globals())
'''


def test_a_deferred_device_error_is_reported_against_the_test_that_issued_it(tmp_path):
    """The shim ends each neuron test with a sync point: the failed kernel of the first test
    is its own teardown error, and the next test, which syncs, passes."""
    record, outcomes = _run_generated_file(tmp_path, "test_deferring.py", DEFERRING)
    assert outcomes == {"test_a_leaves_a_failed_kernel_neuron": "error", "test_b_syncs_neuron": "pass"}
    message = record["tests"][next(n for n in record["tests"] if "test_a_" in n)][1]
    assert "index_put_" in message
