"""The drafter's primitives for dflash.engine on MLX (one row; see backends/torch/draft_runner.py). Everything stays
lazy: the proposals feed the verify forward as an array."""

from __future__ import annotations

import mlx.core as mx

from dflash.engine import Draft, Pending

from .draft_cache import DraftContextCache
from .drafter import DFlashDrafter


class MLXDraft:
    def __init__(self, drafter: DFlashDrafter, embed, lm_head, dtype, *, window: int | None = None):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        spec = drafter.spec
        self.cache = DraftContextCache(spec, dtype, window=window)
        self.width, self.dtype = spec.hidden_size * spec.num_context_layers, dtype
        # slots 1..B-1 of every block are the mask token: embed them once (for any block size up to the trained)
        self._mask_embeds = embed(mx.full((1, spec.block_size - 1), spec.mask_token_id, dtype=mx.int32))
        mx.eval(self._mask_embeds)

    @property
    def position(self) -> int:
        return self.cache.position

    def extend(self, pending: Pending | None) -> None:
        """Append context K/V without drafting (prefill). Context K/V depends only on the features, not on the
        block or on earlier layers' outputs, so a long prompt is absorbed chunk by chunk with projections alone."""
        if pending is None or pending.features.shape[1] == 0:
            return
        n, cache = pending.features.shape[1], self.cache
        cache.reserve(n)
        ctx = self.drafter.project_context(pending.features)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.context_kv(ctx, self.drafter.rope, cache.position)
            cache.write(i, k, v, [n], 0)
        cache.advance([n])

    def propose(self, anchor_ids: mx.array, pending: Pending | None, block_size: int, top_k: int = 0,
                temperature: float = 1.0) -> Draft:
        block = mx.concatenate([self.embed(anchor_ids), self._mask_embeds[:, : block_size - 1]], axis=1)
        features = pending.features if pending is not None else mx.zeros((1, 0, self.width), dtype=self.dtype)
        counts = pending.counts if pending is not None else [0]
        n, cache = features.shape[1], self.cache
        start = cache.position
        cache.reserve(n + block_size)
        # (quantized matmuls must not see an empty input: no new context, no projection)
        ctx = self.drafter.project_context(features) if n else mx.zeros((1, 0, block.shape[2]), block.dtype)
        x = block
        for i, layer in enumerate(self.drafter.layers):
            x = layer(x, ctx, self.drafter.rope, start, cache, i, counts)
        cache.advance(counts)
        logits = self.lm_head(self.drafter.norm(x)[:, 1:])
        draft = Draft(mx.concatenate([anchor_ids, mx.argmax(logits, axis=-1).astype(mx.int32)], axis=1))
        if top_k:
            probs = mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)
            ids = mx.argsort(-probs, axis=-1)[..., :top_k]
            draft.top_ids, draft.top_probs = ids, mx.take_along_axis(probs, ids, axis=-1)
        mx.async_eval(draft.ids)  # the draft runs while Python builds the verify graph
        return draft

    def crop(self, position: int) -> bool:
        return self.cache.crop(position)

    def reset(self) -> None:
        self.cache.reset()

    def state(self) -> list:
        return self.cache.state()

    def spawn(self):
        self.cache.merge(None)  # refuses in one line: MLX decodes one row

    def merge(self, other) -> None:
        self.cache.merge(other)

    def select(self, rows: list[int]) -> None:
        pass  # one row
