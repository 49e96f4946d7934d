"""The target's full-attention K/V on torch: transformers' DynamicLayer, with buffers that grow by doubling.

transformers' DynamicLayer appends a forward's K/V by concatenation, which copies the whole cache (and allocates a
new one) in every layer at every step, so a decoding step costs more the longer the output: on the bundled pair's
8 layers, after 2000 tokens, 16 MB copied per step. Here a forward writes its entries in place after the cached ones
and `crop` (every verify that rejects part of its block) only moves the end; a full buffer is copied into one twice
its size (up to the target's context), so the copying amortises to a constant per token. `keys` / `values` are views
of the live positions, so every transformers attention reads them as it would a DynamicLayer's.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from .rewind import CacheRewind


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose K/V live in (row capacity, heads, capacity, head_dim) buffers; `rows` rows of `length`
    positions are live. A tensor assigned to `keys` / `values` (a batch selection of transformers' own) becomes that
    buffer as it is (keys and values are assigned one after the other, so each keeps its own length until both are);
    the next write copies them into buffers of the layer's own first, so no tensor another cache may hold is written
    to. The row operations (`join`, `take_rows`, `gather_slots`) are RowSlots' for dflash.core.rows.SharedRows: a
    joining row is one row's copy into a spare row, rows leaving from the end move nothing."""

    def __init__(self, limit: int | None = None, **kwargs):
        self.limit = limit  # capacity never grows past this (the target's context), unless a forward needs it
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._lengths = [0, 0]  # live positions of keys, values
        self._rows = 0  # live rows (the buffers may hold room for more)
        self.owned = False  # whether the buffers were allocated here (and may be written in place)
        self.growths = 0  # buffer reallocations so far (each one copies the cache once)
        super().__init__(**kwargs)

    @property
    def length(self) -> int:
        return self._lengths[0]

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:self._rows, :, :self._lengths[0]]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._k, self.owned = tensor, False
        self._lengths[0] = 0 if tensor is None else tensor.shape[-2]
        self._rows = 0 if tensor is None else tensor.shape[0]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:self._rows, :, :self._lengths[1]]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._v, self.owned = tensor, False
        self._lengths[1] = 0 if tensor is None else tensor.shape[-2]
        self._rows = 0 if tensor is None else tensor.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None or self._v is None else min(self._k.shape[-2], self._v.shape[-2])

    @property
    def row_capacity(self) -> int:
        return 0 if self._k is None or self._v is None else min(self._k.shape[0], self._v.shape[0])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._lengths[0] != self._lengths[1]:
            raise RuntimeError(f"GrowingLayer: {self._lengths[0]} keys but {self._lengths[1]} values cached")
        if self._k is None:
            self._rows = key_states.shape[0]
        start, end = self.length, self.length + key_states.shape[-2]
        self._fit(self._rows, end, key_states, value_states)
        assert self._k is not None and self._v is not None  # (_fit made them)
        self._k[:self._rows, :, start:end] = key_states
        self._v[:self._rows, :, start:end] = value_states
        self._lengths = [end, end]
        return self.keys, self.values

    def _fit(self, rows: int, end: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers of the layer's own with room for `rows` rows of `end` positions (twice the old capacities, the
        positions' within the limit), holding the live entries."""
        if self.owned and end <= self.capacity and rows <= self.row_capacity:
            return
        capacity = max(end, 2 * self.capacity) if end > self.capacity else self.capacity
        if self.limit:
            capacity = max(end, min(capacity, self.limit))
        row_capacity = max(rows, 2 * self.row_capacity) if rows > self.row_capacity else self.row_capacity
        old_k, old_v, n, live = self._k, self._v, self.length, self._rows
        shape = lambda s: (row_capacity, s.shape[1], capacity, s.shape[-1])  # noqa: E731
        self._k = new_k = key_states.new_empty(shape(key_states))
        self._v = new_v = value_states.new_empty(shape(value_states))
        if n and live:
            assert old_k is not None and old_v is not None  # (n positions cached)
            new_k[:live, :, :n] = old_k[:live, :, :n]
            new_v[:live, :, :n] = old_v[:live, :, :n]
        self.owned = True
        self.growths += 1

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop: got {tokens_to_remove}, expected the negative number of positions to remove")
        self._lengths = [max(n + tokens_to_remove, 0) for n in self._lengths]

    # ---- rows (RowSlots) -------------------------------------------------------------------------------------------
    def join(self, other: "GrowingLayer", pad_mine: int, pad_theirs: int) -> None:
        """Append other's rows after mine, each side left-padded with zeros to one width."""
        theirs_k, theirs_v = other.keys, other.values
        assert theirs_k is not None and theirs_v is not None  # (a prefilled row)
        mine, n, width = self._rows, self.length, self.length + pad_mine
        if self._k is None:  # (an empty batch takes the row as it is)
            self.update(theirs_k, theirs_v)
            return
        self._fit(mine + other.rows, width, theirs_k, theirs_v)
        assert self._k is not None and self._v is not None  # (_fit made them)
        for buffer, new in ((self._k, theirs_k), (self._v, theirs_v)):
            if pad_mine:  # my rows move right (a longer row joins): the one case that copies the batch
                buffer[:mine, :, pad_mine:width] = buffer[:mine, :, :n].clone()
                buffer[:mine, :, :pad_mine] = 0
            buffer[mine:mine + other.rows, :, :pad_theirs] = 0
            buffer[mine:mine + other.rows, :, pad_theirs:width] = new
        self._rows, self._lengths = mine + other.rows, [width, width]

    def take_rows(self, rows: list[int]) -> None:
        """Keep these rows, in this order: rows that keep their place are not copied (leaving from the end is free)."""
        first = next((j for j, row in enumerate(rows) if row != j), len(rows))
        if first < len(rows):
            keys, values = self.keys, self.values
            assert keys is not None and values is not None  # (rows to move)
            self._fit(self._rows, self.length, keys, values)
            assert self._k is not None and self._v is not None  # (_fit made them)
            idx = torch.tensor(rows[first:], device=self._k.device)
            n = self.length
            self._k[first:len(rows), :, :n] = self._k[idx, :, :n]  # (advanced indexing reads a copy first)
            self._v[first:len(rows), :, :n] = self._v[idx, :, :n]
        self._rows = len(rows)

    def gather_slots(self, index: torch.Tensor) -> None:
        """Row i keeps its slots index[i] (rows, W), in that order, at slots 0 .. W - 1."""
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # (slots to gather)
        self._fit(self._rows, self.length, keys, values)
        assert self._k is not None and self._v is not None  # (_fit made them)
        width = index.shape[1]
        gather = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        gathered_k, gathered_v = keys.gather(2, gather), values.gather(2, gather)
        self._k[:self._rows, :, :width] = gathered_k
        self._v[:self._rows, :, :width] = gathered_v
        self._lengths = [width, width]


class RowSlots:
    """dflash.core.rows.SlotBuffers over a transformers cache (what the target's forwards write into); SharedRows
    decides, these move the entries. Rows of a batch live on GrowingLayers; a lone row's cache may also be a static
    one, or hold sliding-window / linear-attention layers that `rewind` restores."""

    def __init__(self, cache, rewind: CacheRewind | None = None):
        self.cache, self.rewind = cache, rewind

    @property
    def layers(self) -> list[GrowingLayer]:
        return self.cache.layers

    @torch.inference_mode()
    def drop_last(self, n: int) -> bool:
        if self.rewind is not None:
            return self.rewind.rewind(n)
        self.cache.crop(-n)
        return True

    @torch.inference_mode()
    def pack_tail(self, start: int, slots: list[int], width: int) -> None:
        n = len(slots)
        idx = start + torch.tensor(slots, device=self.layers[0].device)  # (one index for every layer)
        for layer in self.layers:  # (copying only the kept entries)
            for kv in (layer.keys, layer.values):
                assert kv is not None  # (a forward filled them)
                kv[:, :, start:start + n] = kv[:, :, idx]
        self.cache.crop(n - width)

    def gather_slots(self, index: np.ndarray) -> None:
        idx = torch.from_numpy(index).to(self.layers[0].device)
        for layer in self.layers:
            layer.gather_slots(idx)

    def take_rows(self, rows: list[int]) -> None:
        for layer in self.layers:
            layer.take_rows(rows)

    def join(self, other: "RowSlots", pad_mine: int, pad_theirs: int) -> None:
        for mine, theirs in zip(self.layers, other.layers):
            mine.join(theirs, pad_mine, pad_theirs)

    def copy_row(self, row: int, slots: np.ndarray, into: "RowSlots") -> None:
        idx = torch.from_numpy(slots).to(self.layers[0].device)
        for i, layer in enumerate(self.layers):
            keys, values = layer.keys, layer.values
            assert keys is not None and values is not None  # (a live row)
            into.cache.update(keys[row:row + 1, :, idx], values[row:row + 1, :, idx], i)  # (indexing copies)


def growing(cache, limit: int | None):
    """A fresh transformers cache with its plain DynamicLayers made GrowingLayers (layers of other kinds keep
    their own)."""
    cache.layers = [GrowingLayer(limit) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = lambda: GrowingLayer(limit)
    return cache


class WindowedStaticLayer(StaticLayer):
    """A StaticLayer (fixed buffers, what torch.compile and CUDA graphs want) whose forwards attend over the first
    `window` positions only: a static cache attends over all of its buffer every step, which on a CPU costs more than
    the step's matmuls (the bundled pair: 11 ms a compiled plain step over 2048 positions, 6 ms over a 256-position
    window). The target sets `window` before each forward to a power of two covering what the forward sees, so the
    window's value changes rarely."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.window = max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys[:, :, :self.window], values[:, :, :self.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window, 0


def windowed(cache: StaticCache) -> StaticCache:
    """A fresh StaticCache with its full-attention layers made WindowedStaticLayers."""
    cache.layers = [WindowedStaticLayer(layer.max_cache_len) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]
    return cache


def attention_window(needed: int, capacity: int) -> int:
    """The positions a static buffer's forward attends over: the smallest power of two >= `needed` (>= 256), within
    the buffer, so that the window's value changes rarely (a compiled forward is specialised on its first one)."""
    return min(max(256, 1 << (needed - 1).bit_length()), capacity)


def set_window(cache: StaticCache, needed: int) -> None:
    """Every windowed layer attends over attention_window(needed) positions of its buffer."""
    for layer in cache.layers:
        if isinstance(layer, WindowedStaticLayer):
            layer.window = attention_window(needed, layer.max_cache_len)


def window_of(cache: StaticCache) -> int:
    """The window the cache's forwards attend over now (set_window's)."""
    return next(layer.window for layer in cache.layers if isinstance(layer, WindowedStaticLayer))
