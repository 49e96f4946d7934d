"""Tree verification on an mlx-lm target without patching mlx-lm: for one forward, every attention's RoPE reads
per-token positions (root position + depth) and the trunk's mask is the tree's ancestor mask; after the walk, the
accepted path's K/V is gathered into place in each KVCache."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from dflash.core.tree import TreeInputs


class _RopeAt(nn.Module):
    """A layer's RoPE at explicit positions: the T tokens become T batch entries, each with its own offset."""

    def __init__(self, rope, positions: mx.array):
        super().__init__()
        self.rope, self.positions = rope, positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # x (1, heads, T, D) -> (T, heads, 1, D): mx.fast.rope takes one offset per batch entry
        return self.rope(x.transpose(2, 1, 0, 3), offset=self.positions).transpose(2, 1, 0, 3)


def _attention(layer):
    return getattr(layer, "self_attn", None)


def tree_refusal(runner, cache: list) -> str | None:
    if not runner.split:
        return (f"{runner.model.model_type if hasattr(runner.model, 'model_type') else 'this family'}: tree "
                "verification on MLX runs decoders whose trunk takes its mask from the cache (llama, mistral, "
                "qwen2/qwen3 and their MoE variants)")
    if any(type(c) is not KVCache for c in cache):
        return "the target's mlx-lm cache is not a plain KVCache (quantized or rotating KV cache)"
    if any(_attention(layer) is None or "rope" not in _attention(layer) for layer in runner.layers):
        return "the target's attention layers have no `rope` module to give per-token positions"
    return None


@contextmanager
def tree_positions(layers, cache: list, tree: TreeInputs):
    offset, t = cache[0].offset, tree.width
    positions = mx.array(offset + tree.depths[0], dtype=mx.int32)
    mask = mx.concatenate([mx.ones((t, offset), dtype=mx.bool_), mx.array(tree.allowed[0])], axis=1)
    ropes = [_attention(layer).rope for layer in layers]
    for layer, rope in zip(layers, ropes):
        _attention(layer).rope = _RopeAt(rope, positions)
    cache[0].make_mask = lambda *args, **kwargs: mask[None, None]  # what the trunk asks its first cache for
    try:
        yield
    finally:
        del cache[0].make_mask
        for layer, rope in zip(layers, ropes):
            _attention(layer).rope = rope


def keep_path(cache: list, slots: list[int], width: int) -> None:
    """Keep `slots` (ascending, slot 0 = the root) of the last `width` positions, contiguously."""
    start = cache[0].offset - width
    idx = mx.array([start + s for s in slots], dtype=mx.int32)
    n = len(slots)
    for c in cache:
        keys, values = mx.take(c.keys, idx, axis=2), mx.take(c.values, idx, axis=2)
        c.keys[..., start:start + n, :] = keys
        c.values[..., start:start + n, :] = values
        c.offset = start + n
