"""LRU caches that count hits, misses and evictions: the plan cache and the kernel cache.

Entry point: :class:`CountingLRU`, a cachetools ``LRUCache`` whose ``stats()`` is what
``adaptive_eager.stats()`` reports for each cache.
"""
from __future__ import annotations

import cachetools


class CountingLRU(cachetools.LRUCache):
    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize=maxsize)
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def popitem(self):
        self.evictions += 1
        return super().popitem()

    def lookup(self, key):
        """The cached value, or None; counts a hit or a miss."""
        value = self.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "size": len(self)}

    def reset_counters(self) -> None:
        self.hits = self.misses = self.evictions = 0
