"""Where in the user's code an op was issued, captured cheaply on every op.

Entry point: :func:`capture_location`. It walks frames outwards to the first one whose
file is not part of torch, this project or a few stdlib wrappers, and returns a small
:class:`SourceLocation`. Whether a code object is internal is cached per code object, so
the walk costs a few dict lookups. Ops issued by the autograd engine have no user frame;
they are located by the backward node that issued them (``MulBackward0``).

With ``NEURON_FULL_STACK=1`` the whole user stack is kept as well (slow; for debugging).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
import warnings

import torch

from .. import _C as _native
from .config import CONFIG

_INTERNAL_DIRS: list[str] = [
    os.path.dirname(torch.__file__) + os.sep,
    # the device package (this file is in its core/)
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
]
_INTERNAL_FILES = {contextlib.__file__, functools.__file__}
_INTERNAL_CODE: dict = {}
_user_frame = _native.user_frame


def add_internal_dir(path: str) -> None:
    """Frames from files under ``path`` are never reported as the user's line."""
    path = os.path.dirname(os.path.abspath(path)) + os.sep if os.path.isfile(path) else path
    if not path.endswith(os.sep):
        path += os.sep
    if path not in _INTERNAL_DIRS:
        _INTERNAL_DIRS.append(path)
        _INTERNAL_CODE.clear()
        _native.user_frame_reset()


def is_internal(filename: str) -> bool:
    if filename in _INTERNAL_FILES or filename.startswith("<frozen"):
        return True
    return filename.startswith(tuple(_INTERNAL_DIRS))


class SourceLocation:
    """The user's frame that issued an op: ``file:line in function``."""

    __slots__ = ("filename", "lineno", "function", "stack")

    def __init__(self, filename: str, lineno: int, function: str, stack=None) -> None:
        self.filename = filename
        self.lineno = lineno
        self.function = function
        self.stack = stack

    def __str__(self) -> str:
        if self.lineno == 0:
            return self.filename
        return f"{self.filename}:{self.lineno} in {self.function}"

    __repr__ = __str__


def capture_location(depth: int = 2):
    """The issuing frame as a raw ``(code, instruction offset)`` pair (cheap; see
    :func:`source_location`). The offset, not the line: a frame's line number is computed by
    walking its code's line table from the start, which costs as much as the code is long
    (a compiled graph's generated code runs hundreds of ops in one function), and is
    needed only when an error is reported.

    The walk is C's (``_C.user_frame``, over the interpreter's own frames) unless the
    whole stack is kept or this interpreter's frames cannot be read; then the frame
    objects are walked here, from ``depth`` (both skip the same frames: this function and
    the device's, all internal)."""
    if not CONFIG.full_stack:
        found = _user_frame(is_internal)
        if found is not NotImplemented:
            return found if found is not None else _no_user_frame()
    frame = sys._getframe(depth)
    cache = _INTERNAL_CODE
    while frame is not None:
        code = frame.f_code
        internal = cache.get(code)
        if internal is None:
            internal = cache[code] = is_internal(code.co_filename)
        if not internal:
            if CONFIG.full_stack:
                return (code, frame.f_lasti, traceback.extract_stack(frame))
            return (code, frame.f_lasti)
        frame = frame.f_back
    return _no_user_frame()


def _no_user_frame():
    """No frame is the user's: an op the autograd engine issued, located by its node."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return (f"<autograd backward: {node.name()}>", 0)
    return ("<unknown>", 0)


def warn_at_user_line(message: str, category=UserWarning) -> None:
    """Warn as a CPU kernel's ``TORCH_WARN`` does: attributed to the user's line (the first
    frame :func:`capture_location` would report), under the warning filters and the
    once-per-location registry of that frame's module."""
    frame = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    globals_ = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=globals_.get("__name__"), registry=globals_.setdefault("__warningregistry__", {}))


# generated code (a compiled graph's FX code) -> lineno -> the user's SourceLocation or None
_GENERATED: dict = {}


def register_generated_code(filename: str, locate) -> None:
    """Ops issued from ``filename`` (a compiled graph's generated code) are located by
    ``locate(lineno)``: the user's line the graph node came from."""
    _GENERATED[filename] = locate


def _line_of(code, offset: int) -> int:
    """The source line of the instruction at byte ``offset`` of ``code``."""
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return line
    return code.co_firstlineno


def source_location(raw) -> SourceLocation:
    """The :class:`SourceLocation` of a raw location from :func:`capture_location`."""
    if isinstance(raw, SourceLocation) or raw is None:
        return raw
    code, lineno = raw[0], raw[1]
    stack = raw[2] if len(raw) > 2 else None
    if isinstance(code, str):
        return SourceLocation(code, 0, "", stack)
    lineno = _line_of(code, lineno)
    locate = _GENERATED.get(code.co_filename)
    if locate is not None:
        located = locate(lineno)
        if located is not None:
            located.stack = stack
            return located
    return SourceLocation(code.co_filename, lineno, code.co_name, stack)
