"""The drafter's context K/V on MLX: the position-indexed design of backends/torch/draft_cache.py, laid out by
dflash.core.draft_context.ContextLayout, with per-layer buffers (rows, kv_heads, capacity, head_dim). One row: mlx-lm's
caches keep one offset per batch, so MLX decodes a single sequence at a time."""

from __future__ import annotations

import mlx.core as mx

from dflash.core.draft_context import ContextCache, ContextLayout, draft_visible, layer_rules
from dflash.core.errors import DFlashError


class DraftContextCache(ContextCache):
    def __init__(self, spec, dtype, capacity: int = 512, window: int | None = None):
        self.spec, self.window = spec, window
        self.rules = layer_rules(spec)
        self.layout = ContextLayout(capacity, window)
        shape = (1, spec.num_key_value_heads, capacity, spec.head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(spec.num_hidden_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(spec.num_hidden_layers)]

    def reserve(self, n: int) -> None:
        shift, capacity = self.layout.plan_reserve(n)
        if shift or capacity > self.k[0].shape[2]:
            used = self.layout.slot(self.layout.position)
            for buf in (self.k, self.v):
                for i, a in enumerate(buf):
                    keep = a[:, :, shift:used]
                    pad = mx.zeros((*a.shape[:2], capacity - keep.shape[2], a.shape[3]), dtype=a.dtype)
                    buf[i] = mx.concatenate([keep, pad], axis=2)
        self.layout.apply_reserve(shift, capacity)

    def write(self, layer: int, k: mx.array, v: mx.array, counts: list[int], block: int):
        """Store the row's new context + block K/V at its length; return the span this layer attends to and its
        boolean mask (None: every slot of the span, for every block slot)."""
        layout, rule = self.layout, self.rules[layer]
        at = layout.slot(layout.position)
        self.k[layer][:, :, at:at + k.shape[2]] = k
        self.v[layer][:, :, at:at + k.shape[2]] = v
        lo, hi = layout.span(rule, [layout.position + counts[0]], block)
        mask = None
        if block and rule.needs_mask:
            anchor = at + k.shape[2] - block - lo
            q = anchor + mx.arange(block)[:, None]
            mask = draft_visible(q, mx.arange(hi - lo)[None], anchor, block, window=self.window,
                                 sliding=rule.sliding, causal=rule.causal)
        return self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi], mask

    def state(self) -> list[mx.array]:
        return self.k + self.v

    def merge(self, other) -> None:
        raise DFlashError("--batch-size: batched decoding runs on the torch backend; use --backend torch or "
                          "--batch-size 1")
