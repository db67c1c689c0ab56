"""``nki.collectives``: importable, not simulated (the SDK's CPU simulator does not implement
collectives either, ``nki/guides/nki_simulator.rst`` "Known Gaps")."""
from __future__ import annotations

from ._state import fail


class ReplicaGroup:
    """A group of ranks taking part in a collective."""

    def __init__(self, *groups, **kwargs):
        self.groups = groups
        self.options = kwargs


def _unsupported(name):
    def fn(*args, **kwargs):
        fail(f"nki.collectives.{name}", "collectives are not simulated (nor by the SDK's CPU simulator)")

    fn.__name__ = name
    return fn


for _name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute", "send", "recv",
              "all_to_all_v", "collective_permute_implicit"):
    globals()[_name] = _unsupported(_name)
