"""The drafter's primitives for dflash.core.engine on MLX (one row; see backends/torch/draft_runner.py). Everything stays
lazy: the proposals feed the verify forward as an array."""

from __future__ import annotations

import mlx.core as mx

from dflash.core.contract import Draft, Pending
from dflash.core.sampling import RowDraw, noise_key

from .draft_cache import DraftContextCache
from .drafter import DFlashDrafter, scale_logits, select_walk, top_k_sorted
from .sampling import MLXSampler, inverse_cdf

Q_CANDIDATES = 64  # rejection: q is the draft's filtered distribution on its 64 most probable tokens, renormalised


class MLXDraft:
    def __init__(self, drafter: DFlashDrafter, embed, lm_head, dtype, *, window: int | None = None,
                 logit_scaling: tuple[float, float | None] = (1.0, None)):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.logit_scaling = logit_scaling  # (multiplier, softcap): DraftSpec.logit_scaling
        spec = drafter.spec
        self.distribution = spec.is_dflash2  # the selector's q_t: a draft distribution of its own
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
                draws: list[RowDraw] | None = None) -> Draft:
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
        draw = draws[0] if draws is not None else None
        if spec.is_dflash2:
            draft = self.selector_walk(anchor_ids, logits, hidden, draw)
        else:
            draft = self.choose(anchor_ids, logits, draw, top_k)
        if top_k and draft.top_ids is None:
            draft.top_ids, draft.top_probs = top_k_sorted(mx.softmax(logits.astype(mx.float32), axis=-1), top_k)
        mx.async_eval(draft.ids)  # the draft runs while Python builds the verify graph
        return draft

    def choose(self, anchor_ids: mx.array, logits: mx.array, draw: RowDraw | None, top_k: int) -> Draft:
        """[anchor, proposals] of a DFlash block by the row's rule (backends/torch/draft_runner.py: the same)."""
        draft = Draft(None)
        if draw is None or draw.rule == "greedy":
            proposals = mx.argmax(logits, axis=-1)
        else:
            filtered = MLXSampler(draw.params).filtered(logits[0])
            if draw.rule == "match":
                perturbed = filtered + draw.gumbel[: filtered.shape[0]]
                proposals = mx.argmax(perturbed, axis=-1)[None]
                if top_k:
                    draft.top_ids, draft.top_probs = top_k_sorted(mx.softmax(perturbed, axis=-1)[None], top_k)
            else:
                ids, probs = top_k_sorted(mx.softmax(filtered, axis=-1), min(Q_CANDIDATES, filtered.shape[-1]))
                probs = probs / probs.sum(axis=-1, keepdims=True)
                pick = inverse_cdf(probs, mx.array(draw.draft_u[: filtered.shape[0]]))
                proposals = mx.take_along_axis(ids, pick[:, None], axis=-1)[:, 0][None]
                draft.q_ids, draft.q_probs = ids[None], probs[None]
        draft.ids = mx.concatenate([anchor_ids, proposals.astype(mx.int32)], axis=1)
        return draft

    def selector_walk(self, anchor_ids: mx.array, logits: mx.array, hidden: mx.array, draw: RowDraw | None) -> Draft:
        """DFlash2: the selector's walk, greedy, or for a rejection row sampled from q_t = softmax(S_t(a, .) / T)
        with a key of the draft stream at the block's first position (q returned with the draft)."""
        spec = self.drafter.spec
        candidates, scores = self.drafter.candidate_selector.pair_scores(logits.astype(mx.float32), hidden,
                                                                         anchor_ids, spec.selector_top_k)
        if draw is None or draw.rule != "rejection":
            proposals, _ = select_walk(candidates, scores)
            return Draft(mx.concatenate([anchor_ids, proposals.astype(mx.int32)], axis=1))
        t = draw.params.temperature
        key = mx.random.key(noise_key(draw.sampling.seed, "draft", draw.position))
        proposals, rows = select_walk(candidates, scores, t, key)
        draft = Draft(mx.concatenate([anchor_ids, proposals.astype(mx.int32)], axis=1))
        draft.q_ids, draft.q_probs = candidates, mx.softmax(rows / t, axis=-1)
        return draft

    def crop(self, position: int) -> bool:
        return self.cache.crop(position)

    def reset(self) -> None:
        self.cache.reset()

    def state(self) -> list:
        return self.cache.state()

    def spawn(self):
        self.cache.merge(None)  # refuses in one line: MLX decodes one row

    extract = spawn

    def merge(self, other) -> None:
        self.cache.merge(other)

    def select(self, rows: list[int]) -> None:
        pass  # one row
