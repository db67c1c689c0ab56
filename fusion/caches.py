"""LRU caches that count hits, misses and evictions: the plan cache and the kernel cache.

Entry point: :class:`CountingLRU`, whose ``stats()`` is what ``adaptive_eager.stats()``
reports for each cache.

Built on ``collections.OrderedDict``: a lookup is one ``get`` and one ``move_to_end``, both
C calls, so a key is hashed twice. The plan cache is looked up at every flush with a key
of a few hundred items, and tuples do not cache their hash: cachetools' LRUCache hashed it
three times through three Python frames (0.3 us per recorded op on a GPT training step,
bench/overhead.py).
"""
from __future__ import annotations

from collections import OrderedDict


class CountingLRU:
    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.generation = 0  # entries added or removed so far (a ticket holds while it stays)
        self.moves = 0  # entries made the most recently used so far

    def lookup(self, key):
        """The cached value (now the most recently used), or None; counts a hit or a miss."""
        value = self._data.get(key)
        if value is None:
            self.misses += 1
        else:
            self._data.move_to_end(key)
            self.moves += 1
            self.hits += 1
        return value

    def lookup_ticket(self, key):
        """``lookup``, and a ticket for :meth:`relookup`: ``(value, ticket)``, or ``(None,
        None)`` on a miss."""
        value = self.lookup(key)
        if value is None:
            return None, None
        return value, [self.generation, self.moves, key, value]

    def relookup(self, ticket):
        """The ticket's value again, as a ``lookup`` of its key counts and orders it, without
        hashing the key (a compiled graph's plan-cache key has hundreds of items; an
        OrderedDict hashes it to move it, and to iterate from it) while no entry was added or
        removed since the ticket; None (nothing counted) otherwise."""
        generation, moves, key, value = ticket
        if generation != self.generation:
            return None
        if moves != self.moves:  # another entry was used since: this one becomes the most recent
            self._data.move_to_end(key)
            self.moves += 1
            ticket[1] = self.moves
        self.hits += 1
        return value

    def __setitem__(self, key, value) -> None:
        data = self._data
        data[key] = value
        data.move_to_end(key)
        self.generation += 1
        self.moves += 1
        while len(data) > self.maxsize:
            data.popitem(last=False)
            self.evictions += 1

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def pop(self, key, default=None):
        self.generation += 1
        return self._data.pop(key, default)

    def clear(self) -> None:
        self.generation += 1
        self._data.clear()

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "size": len(self)}

    def reset_counters(self) -> None:
        self.hits = self.misses = self.evictions = 0
