"""dflash.core.rows.SlotBuffers over mlx-lm's KVCache: the K/V entries of the target cache's rows, moved where
dflash.core.rows.SharedRows says. A KVCache's buffers are allocated in steps of 256 slots and `offset` of them are
live; every row operation leaves buffers holding exactly the live slots (the next forward grows them again). A lone
row's cache may also hold rotating or recurrent layers, which `rewind` restores."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import trim_prompt_cache

from dflash.core.errors import DFlashError

from .rewind import MLXRewind


class RowSlots:
    def __init__(self, cache: list, rewind: MLXRewind | None = None):
        self.cache, self.rewind = cache, rewind

    def drop_last(self, n: int) -> bool:
        if self.rewind is not None:
            return self.rewind.rewind(n)
        # a rotating cache stops being trimmable once it wraps; rewinding it silently would corrupt the output
        if trim_prompt_cache(self.cache, n) != n:
            raise DFlashError(f"the target's mlx-lm cache could not be rewound by {n} positions (a rotating or "
                              "sliding cache that already wrapped)")
        return True

    def pack_tail(self, start: int, slots: list[int], width: int) -> None:
        idx, n = mx.array([start + s for s in slots], dtype=mx.int32), len(slots)
        for c in self.cache:  # (copying only the kept entries)
            keys, values = mx.take(c.keys, idx, axis=2), mx.take(c.values, idx, axis=2)
            c.keys[..., start:start + n, :] = keys
            c.values[..., start:start + n, :] = values
            c.offset = start + n

    def gather_slots(self, index: np.ndarray) -> None:
        idx = mx.array(index, dtype=mx.int32)[:, None, :, None]
        for c in self.cache:
            keys, values = _filled(c)
            c.keys, c.values = mx.take_along_axis(keys, idx, axis=2), mx.take_along_axis(values, idx, axis=2)
            c.offset = index.shape[1]

    def take_rows(self, rows: list[int]) -> None:
        idx = mx.array(rows, dtype=mx.int32)
        for c in self.cache:
            c.keys, c.values = c.keys[idx], c.values[idx]
        mx.clear_cache()  # (the rows that left: see MLXTarget.settle)

    def join(self, other: "RowSlots", pad_mine: int, pad_theirs: int) -> None:
        for mine, theirs in zip(self.cache, other.cache):
            mine.keys, mine.values = (mx.concatenate([_left_pad(x, pad_mine), _left_pad(y, pad_theirs)])
                                      for x, y in zip(_filled(mine), _filled(theirs)))
            mine.offset = mine.keys.shape[2]

    def copy_row(self, row: int, slots: np.ndarray, into: "RowSlots") -> None:
        idx = mx.array(slots, dtype=mx.int32)
        for mine, theirs in zip(into.cache, self.cache):
            mine.keys, mine.values = (mx.take(x[row:row + 1], idx, axis=2) for x in _filled(theirs))
            mine.offset = mine.keys.shape[2]
        mx.eval([c.state for c in into.cache])  # its own buffers now: unevaluated, they would pin the whole batch's


def _filled(cache) -> tuple[mx.array, mx.array]:
    """A KVCache's keys and values up to its offset (its buffers are allocated in steps of 256 slots)."""
    return cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :]


def _left_pad(x: mx.array, n: int) -> mx.array:
    return mx.pad(x, [(0, 0), (0, 0), (n, 0), (0, 0)]) if n else x
