"""The drafter's primitives for dflash.engine on MLX (one row; see backends/torch/draft_runner.py). Everything stays
lazy: the proposals feed the verify forward as an array."""

from __future__ import annotations

import random

import mlx.core as mx

from dflash.engine import Draft, Pending

from .draft_cache import DraftContextCache
from .drafter import DFlashDrafter, scale_logits, select_walk, top_k_sorted

DRAFT_NOISE_OFFSET = 0x5EED_D2  # the draft's stream: seed + offset, never the target sampler's own seed


class MLXDraft:
    def __init__(self, drafter: DFlashDrafter, embed, lm_head, dtype, *, window: int | None = None,
                 logit_scaling: tuple[float, float | None] = (1.0, None)):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.logit_scaling = logit_scaling  # (multiplier, softcap): DraftSpec.logit_scaling
        spec = drafter.spec
        self.distribution = spec.is_dflash2  # the selector's q_t: proposals can be sampled (rejection verification)
        self.walk_temperature, self.key = 0.0, None
        self.cache = DraftContextCache(spec, dtype, window=window)
        self.width, self.dtype = spec.hidden_size * spec.num_context_layers, dtype
        # slots 1..B-1 of every block are the mask token: embed them once (for any block size up to the trained)
        self._mask_embeds = embed(mx.full((1, spec.block_size - 1), spec.mask_token_id, dtype=mx.int32))
        if spec.input_embedding_scale is not None:
            self._mask_embeds = self._mask_embeds * spec.input_embedding_scale
        mx.eval(self._mask_embeds)

    @property
    def position(self) -> int:
        return self.cache.position

    def set_sampling(self, params) -> None:
        """Sample the selector's walk at the run's temperature (None: greedy) with keys of its own, split per
        draft: the target's acceptance and residual draws use mlx's global generator, never these."""
        self.walk_temperature, self.key = 0.0, None
        if params is not None and not params.greedy:
            self.walk_temperature = params.temperature
            seed = params.seed + DRAFT_NOISE_OFFSET if params.seed is not None else random.getrandbits(32)
            self.key = mx.random.key(seed)

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
        spec = self.drafter.spec
        anchor_embeds = self.embed(anchor_ids)
        if spec.input_embedding_scale is not None:
            anchor_embeds = anchor_embeds * spec.input_embedding_scale
        block = mx.concatenate([anchor_embeds, self._mask_embeds[:, : block_size - 1]], axis=1)
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
        hidden = self.drafter.norm(x)[:, 1:]
        logits = scale_logits(self.lm_head(hidden), *self.logit_scaling)
        if spec.is_dflash2:  # the selector's greedy walk, built lazily with the forward
            candidates, scores = self.drafter.candidate_selector.pair_scores(logits.astype(mx.float32), hidden,
                                                                             anchor_ids, spec.selector_top_k)
            key = None
            if self.walk_temperature > 0:
                self.key, key = mx.random.split(self.key)
            proposals, rows = select_walk(candidates, scores, self.walk_temperature, key)
        else:
            proposals = mx.argmax(logits, axis=-1)
        draft = Draft(mx.concatenate([anchor_ids, proposals.astype(mx.int32)], axis=1))
        if spec.is_dflash2 and self.walk_temperature > 0:
            draft.q_ids, draft.q_probs = candidates, mx.softmax(rows / self.walk_temperature, axis=-1)
        if top_k:
            probs = mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)
            draft.top_ids, draft.top_probs = top_k_sorted(probs, top_k)
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
