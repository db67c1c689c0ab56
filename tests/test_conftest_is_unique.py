"""Test modules import the shared helpers by name (``from conftest import assert_same``), with
``tests/`` on ``sys.path``. pytest imports every ``conftest.py`` of a folder without an
``__init__.py`` as the module ``conftest``, so a second one anywhere under ``tests/`` replaces the
shared one in ``sys.modules`` and every later ``from conftest import ...`` fails at collection.
Shared fixtures go in ``tests/conftest.py``."""
from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_tests_conftest_is_the_only_conftest():
    found = sorted(os.path.relpath(os.path.join(directory, "conftest.py"), TESTS)
                   for directory, subdirectories, files in os.walk(TESTS)
                   if "conftest.py" in files and "__pycache__" not in directory)
    assert found == ["conftest.py"], found
