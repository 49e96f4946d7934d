"""Explicit positions and masks on an mlx-lm target, without patching mlx-lm: for one forward, every attention's RoPE
reads per-token positions and the trunk's mask is ours. Tree verification (ancestor masks, root position + depth) and
rows sharing a cache (holes, each row at its own position) both run through it; after a tree walk, one row's
accepted path is gathered into place in each KVCache."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache


class _RopeAt(nn.Module):
    """A layer's RoPE at explicit positions: `starts` (rows,) when each row's positions are consecutive, else `flat`
    (rows * T,): the T tokens of every row become batch entries, each with its own offset."""

    def __init__(self, rope, starts: mx.array | None, flat: mx.array):
        super().__init__()
        self.rope, self.starts, self.flat = rope, starts, flat

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if self.starts is not None:
            return self.rope(x, offset=self.starts)
        b, h, t, d = x.shape  # (rows, heads, T, D) -> (rows * T, heads, 1, D)
        y = self.rope(x.transpose(0, 2, 1, 3).reshape(b * t, h, 1, d), offset=self.flat)
        return y.reshape(b, t, h, d).transpose(0, 2, 1, 3)


def _attention(layer):
    return getattr(layer, "self_attn", None)


def positions_refusal(runner, cache: list) -> str | None:
    """Why this target cannot take explicit positions and masks (None: it can)."""
    if not runner.split:
        return (f"{runner.model.model_type if hasattr(runner.model, 'model_type') else 'this family'}: explicit "
                "positions on MLX run decoders whose trunk takes its mask from the cache (llama, mistral, "
                "qwen2/qwen3 and their MoE variants)")
    if any(type(c) is not KVCache for c in cache):
        return "the target's mlx-lm cache is not a plain KVCache (quantized or rotating KV cache)"
    if any(_attention(layer) is None or "rope" not in _attention(layer) for layer in runner.layers):
        return "the target's attention layers have no `rope` module to give per-token positions"
    return None


@contextmanager
def explicit_positions(layers, cache: list, positions: np.ndarray, mask: np.ndarray):
    """For one forward: token j of row i at positions[i, j], attending to the cache slots and new tokens where
    mask[i, j] (rows, T, S + T) is True."""
    consecutive = positions.shape[1] == 1 or bool((np.diff(positions, axis=1) == 1).all())
    starts = mx.array(positions[:, 0], dtype=mx.int32) if consecutive else None
    flat = mx.array(positions.reshape(-1), dtype=mx.int32)
    ropes = [_attention(layer).rope for layer in layers]
    for layer, rope in zip(layers, ropes):
        _attention(layer).rope = _RopeAt(rope, starts, flat)
    boolean = mx.array(mask)[:, None]
    cache[0].make_mask = lambda *args, **kwargs: boolean  # what the trunk asks its first cache for
    try:
        yield
    finally:
        del cache[0].make_mask
        for layer, rope in zip(layers, ropes):
            _attention(layer).rope = rope
