"""``python -m adaptive_eager.stats run.json [other.json] [--json]``: print a fusion-statistics
dump as a readable table, or two side by side. The dump itself is built in
``adaptive_eager/statistics.py``; the tables in ``report_text.py``.
"""
from __future__ import annotations

from .report_text import main

if __name__ == "__main__":
    raise SystemExit(main())
