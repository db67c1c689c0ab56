"""The ``adaptive_eager`` logger hierarchy, silent unless asked.

Loggers: ``adaptive_eager`` (the root of the hierarchy), ``adaptive_eager.fusion`` (the
planner: at DEBUG, one line per refused fusion and its reason, e.g. ``not fusing mul ->
add: would create a cycle``), ``adaptive_eager.window`` (the op window). Any logger whose
name starts with ``adaptive_eager.`` belongs to it.

- By default nothing is printed: the hierarchy has a ``NullHandler`` and no level, so
  Python's "last resort" handler never fires for it.
- ``NEURON_LOG_LEVEL=DEBUG`` (or INFO, WARNING, ERROR, CRITICAL, or a number) sets the
  hierarchy's level and prints its records to stderr, unless the application has set up
  logging itself (the root logger has a handler): then records go there only, once.
- :func:`set_level` does the same from Python: ``adaptive_eager.logs.set_level("DEBUG")``.

Entry point: :func:`setup`, called once by ``import adaptive_eager``.
"""
from __future__ import annotations

import logging
import sys

from adaptive_eager_device.core.config import CONFIG, parse_log_level

ROOT = "adaptive_eager"
FORMAT = "[%(name)s %(levelname)s] %(message)s"


class _StderrUnlessConfigured(logging.StreamHandler):
    """Writes to the current ``sys.stderr``, but only while the root logger has no
    handlers: an application that configured logging gets each record once, its way."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self):  # follow sys.stderr when it is replaced (pytest capture, redirects)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def get_logger(name: str = "") -> logging.Logger:
    """``get_logger("fusion")`` is the ``adaptive_eager.fusion`` logger."""
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def set_level(level) -> None:
    """Set the hierarchy's level (a name or number) and print its records to stderr
    (see the module docstring); ``None`` restores the default: silent."""
    logger = get_logger()
    if level is None:
        logger.setLevel(logging.NOTSET)
        for handler in [h for h in logger.handlers if isinstance(h, _StderrUnlessConfigured)]:
            logger.removeHandler(handler)
        return
    logger.setLevel(parse_log_level(level.strip()) if isinstance(level, str) else int(level))
    if not any(isinstance(h, _StderrUnlessConfigured) for h in logger.handlers):
        logger.addHandler(_StderrUnlessConfigured())


def setup() -> None:
    """Attach the ``NullHandler`` (once) and apply ``NEURON_LOG_LEVEL`` if set."""
    logger = get_logger()
    if not any(type(h) is logging.NullHandler for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
    if CONFIG.log_level is not None:  # a bad value is a configuration error (device/core/config.py)
        set_level(CONFIG.log_level)
