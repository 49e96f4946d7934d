"""Prefixes kept across requests: the caches of finished sequences, bounded in bytes, least recently used first out.

An entry is a one-row dflash.core.engine.Engine (its target K/V and drafter context for the sequence's tokens) taken out
of a batch when the sequence left it. A new prompt takes the entry sharing its longest prefix; the engine crops that
row to the shared prefix and prefills only the rest, so the second turn of a conversation prefills only the new
turn even when other requests ran in between. An entry is used once (its caches become the new row's), and the
new row's own entry replaces it when that request finishes.
"""

from __future__ import annotations

from collections import OrderedDict

from .sampling import common_prefix


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 16):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[int, tuple[list[int], object, int]] = OrderedDict()  # key -> tokens, row, bytes
        self.bytes = 0
        self._next = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, tokens: list[int], row, nbytes: int) -> None:
        if nbytes > self.max_bytes or len(tokens) < self.min_tokens:
            return
        for key, (held, _, size) in list(self.entries.items()):
            if common_prefix(held, tokens) == len(held):  # a shorter prefix of this one: redundant now
                del self.entries[key]
                self.bytes -= size
        self.entries[self._next] = (list(tokens), row, nbytes)
        self._next += 1
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (_, _, size) = self.entries.popitem(last=False)
            self.bytes -= size

    def take(self, prompt: list[int], at_least: int = 0):
        """The entry sharing the longest prefix with prompt[:-1] (more than `at_least` and min_tokens tokens),
        removed from the cache; None if there is none."""
        best, best_key = max(at_least, self.min_tokens - 1), None
        for key, (held, _, _) in self.entries.items():
            n = common_prefix(held, prompt[:-1])
            if n > best:
                best, best_key = n, key
        if best_key is None:
            self.misses += 1
            return None
        self.hits += 1
        _, row, size = self.entries.pop(best_key)
        self.bytes -= size
        return row


def keep_row(cache: PrefixCache, row) -> None:
    """Keep a one-row engine (a row copied out of a batch), cropped to what its drafter has read: target features
    still pending for the drafter are not kept."""
    if row.drafter is not None:
        row.crop(row.drafter.position)
    nbytes = row.target.cache_bytes() + (row.drafter.cache_bytes() if row.drafter is not None else 0)
    cache.put(row.tokens, row, nbytes)
