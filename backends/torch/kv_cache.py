"""The target's full-attention K/V on torch: transformers' DynamicLayer, with buffers that grow by doubling.

transformers' DynamicLayer appends a forward's K/V by concatenation, which copies the whole cache (and allocates a
new one) in every layer at every step, so a decoding step costs more the longer the output: on the bundled pair's
8 layers, after 2000 tokens, 16 MB copied per step. Here a forward writes its entries in place after the cached ones
and `crop` (every verify that rejects part of its block) only moves the end; a full buffer is copied into one twice
its size (up to the target's context), so the copying amortises to a constant per token. `keys` / `values` are views
of the live positions, so every transformers attention reads them as it would a DynamicLayer's.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose K/V live in (batch, heads, capacity, head_dim) buffers; `length` positions are cached.
    A tensor assigned to `keys` / `values` (a merge, a gather, a batch selection) becomes that buffer as it is (keys
    and values are assigned one after the other, so each keeps its own length until both are); the next update
    copies them into buffers of the layer's own before writing, so no tensor another cache may hold is written to."""

    def __init__(self, limit: int | None = None, **kwargs):
        self.limit = limit  # capacity never grows past this (the target's context), unless a forward needs it
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._lengths = [0, 0]  # live positions of keys, values
        self.owned = False  # whether the buffers were allocated here (and may be written in place)
        self.growths = 0  # buffer reallocations so far (each one copies the cache once)
        super().__init__(**kwargs)

    @property
    def length(self) -> int:
        return self._lengths[0]

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, :self._lengths[0]]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._k, self.owned = tensor, False
        self._lengths[0] = 0 if tensor is None else tensor.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, :self._lengths[1]]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._v, self.owned = tensor, False
        self._lengths[1] = 0 if tensor is None else tensor.shape[-2]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None or self._v is None else min(self._k.shape[-2], self._v.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._lengths[0] != self._lengths[1]:
            raise RuntimeError(f"GrowingLayer: {self._lengths[0]} keys but {self._lengths[1]} values cached")
        start, end = self.length, self.length + key_states.shape[-2]
        if not self.owned or end > self.capacity:
            self._grow(key_states, value_states, end)
        assert self._k is not None and self._v is not None  # (_grow made them)
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self._lengths = [end, end]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        """New buffers of room for `end` positions at least (twice the old capacity, within the limit), holding the
        cached positions."""
        capacity = max(end, 2 * self.capacity)
        if self.limit:
            capacity = max(end, min(capacity, self.limit))
        old_k, old_v, n = self._k, self._v, self.length
        shape = lambda s: (*s.shape[:2], capacity, s.shape[-1])  # noqa: E731
        self._k = new_k = key_states.new_empty(shape(key_states))
        self._v = new_v = value_states.new_empty(shape(value_states))
        if n:
            assert old_k is not None and old_v is not None  # (n positions cached)
            new_k[:, :, :n] = old_k[:, :, :n]
            new_v[:, :, :n] = old_v[:, :, :n]
        self.owned = True
        self.growths += 1

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop: got {tokens_to_remove}, expected the negative number of positions to remove")
        self._lengths = [max(n + tokens_to_remove, 0) for n in self._lengths]


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
