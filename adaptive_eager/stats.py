"""``python -m adaptive_eager.stats run.json [other.json] [--json]``: print a fusion-statistics
dump as a readable table, or two side by side. The dump itself is built in
``adaptive_eager/statistics.py``; the tables in ``report_text.py``.

This module shares its name with the function ``adaptive_eager.stats()``, and importing
it makes Python bind the package attribute to the module. So the module is callable, and
calling it is calling that function: no import changes the public API.
"""
from __future__ import annotations

import sys
import types

from .report_text import main
from .statistics import stats as _stats


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _stats(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
