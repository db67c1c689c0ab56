"""Import the simulated ``nki`` before this folder's name can shadow it.

pytest puts ``tests/`` on ``sys.path`` (its conftest lives there, with no ``__init__.py``), so
``import nki`` would find this folder, ``tests/nki``, as a namespace package before the editable
install's finder (which comes after Python's path finder) finds ``device/nki``. Import the real one
with ``tests/`` out of the way; later imports then use ``sys.modules``.
"""
from __future__ import annotations

import os
import sys

_TESTS = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if getattr(sys.modules.get("nki"), "__file__", None) is None:
    sys.modules.pop("nki", None)
    _saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _TESTS]
    try:
        import nki  # noqa: F401
        import nki.isa  # noqa: F401
        import nki.language  # noqa: F401
    finally:
        sys.path[:] = _saved
