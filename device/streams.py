"""Streams and events on the one hardware queue (placeholder: the default stream only)."""
from __future__ import annotations


class StreamState:
    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = 0


STATE = StreamState()
