"""The issuing frame of an op, as every deferred error names it: ``capture_location`` walks the
interpreter's frames in C (``_C.user_frame``) and must give exactly the ``(code, f_lasti)``
the frame objects give, through nested calls, generators, comprehensions and a module added
as internal."""
from __future__ import annotations

import sys

import pytest
import torch
from conftest import keeping_records

from adaptive_eager_device import _C as _native
from adaptive_eager_device.core import location
from adaptive_eager_device.core.config import CONFIG


def _python_walk(is_internal):
    return NotImplemented  # what _C.user_frame says where it cannot read the frames


def _both():
    """capture_location from one call site (one instruction), walked in C, then by the frame
    objects (its Python walk, from this frame: depth 1)."""
    got = []
    try:
        for walk in (_native.user_frame, _python_walk):
            location._user_frame = walk
            got.append(location.capture_location(depth=1))
    finally:
        location._user_frame = _native.user_frame
    return got


def test_the_c_walk_is_the_frame_objects_walk():
    if _native.user_frame(location.is_internal) is NotImplemented:
        pytest.skip("this interpreter's frames are walked in Python")

    def nested(depth):
        return nested(depth - 1) if depth else _both()

    def generator():
        yield _both()

    cases = [_both(), nested(3), next(generator()), [_both() for _ in range(1)][0], (lambda: _both())()]
    for got, expected in cases:
        assert got == expected
        assert got[0].co_filename == __file__


def test_an_op_records_the_users_line_and_a_module_made_internal_is_skipped(monkeypatch, strict_mode):
    x = torch.ones(2, device="neuron")
    with keeping_records() as records:
        _records_the_users_line(x, records, monkeypatch)


def _records_the_users_line(x, records, monkeypatch):
    line = sys._getframe().f_lineno + 1
    x * 2  # noqa: B018 - the op whose line is recorded
    assert location.source_location(records[-1].location).lineno == line

    def helper():
        return x * 3

    monkeypatch.setattr(location, "_INTERNAL_DIRS", list(location._INTERNAL_DIRS))
    helper()
    assert location.source_location(records[-1].location).function == "helper"
    location.add_internal_dir(__file__)  # this file's frames are the library's now
    try:
        helper()
        assert location.source_location(records[-1].location).filename != __file__
    finally:
        location._INTERNAL_DIRS.remove(location._INTERNAL_DIRS[-1])
        location._INTERNAL_CODE.clear()
        _native.user_frame_reset()
    helper()
    assert location.source_location(records[-1].location).function == "helper"


def test_the_full_stack_is_walked_by_frame_objects(monkeypatch):
    monkeypatch.setattr(CONFIG, "full_stack", True)
    code, lasti, stack = location.capture_location(depth=1)
    assert code is sys._getframe().f_code and stack[-1].name == "test_the_full_stack_is_walked_by_frame_objects"
