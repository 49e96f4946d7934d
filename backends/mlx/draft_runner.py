"""The drafter's primitives for dflash.core.engine on MLX (see backends/torch/draft_runner.py): absorb context, propose
a block for every row, rewind, batch rows. Everything stays lazy: the proposals feed the verify forward as an array."""

from __future__ import annotations

import mlx.core as mx

from dflash.core import rules
from dflash.core.contract import Draft, Pending
from dflash.core.errors import DFlashError
from dflash.core.sampling import RowDraw

from .draft_cache import DraftContextCache
from .drafter import DFlashDrafter, scale_logits, spread
from .ops import MLXOps
from .sampling import sampler


def _filtered(params, logits: mx.array) -> mx.array:
    """One row's draft logits (P, V) under the row's sampling filters (mlx-lm's, in transformers' order)."""
    return sampler(params).filtered(logits)


class MLXDraft:
    def __init__(self, drafter: DFlashDrafter, embed, lm_head, dtype, *, window: int | None = None,
                 logit_scaling: tuple[float, float | None] = (1.0, None)):
        self.drafter, self.embed, self.lm_head, self.window = drafter, embed, lm_head, window
        self.logit_scaling = logit_scaling  # (multiplier, softcap): DraftSpec.logit_scaling
        spec = drafter.spec
        # a draft vocabulary: the drafter's own head over its tokens, the logits spread over the target's ids
        self.head = drafter.lm_head if spec.has_draft_vocab else lm_head
        self.vocab_ids = drafter.target_ids() if spec.has_draft_vocab else None
        self.spec = spec
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
        lengths = cache.lengths
        at = lengths[0] if len(set(lengths)) == 1 else mx.array(lengths)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.context_kv(ctx, self.drafter.rope, at)
            cache.write(i, k, v, pending.counts, 0)
        cache.advance(pending.counts)

    @property
    def drafts_some_rows(self) -> bool:
        return True

    def propose(self, anchor_ids: mx.array, pending: Pending | None, block_size: int, top_k: int = 0,
                draws: list[RowDraw] | None = None, rows: list[int] | None = None) -> Draft:
        """(rows: greedy blocks of these rows only, their context copied out of the batch's and their blocks written
        there and forgotten; extend absorbed the pending features first)."""
        if rows is not None and (pending is not None or draws is not None):
            raise DFlashError("propose(rows=...): greedy rows, their pending features absorbed (extend) first")
        spec = self.drafter.spec
        batch = anchor_ids.shape[0]
        anchor_embeds = self.embed(anchor_ids)
        if spec.input_embedding_scale is not None:
            anchor_embeds = anchor_embeds * spec.input_embedding_scale
        masks = mx.broadcast_to(self._mask_embeds[:, : block_size - 1], (batch, block_size - 1, anchor_embeds.shape[2]))
        block = mx.concatenate([anchor_embeds, masks], axis=1)
        features = pending.features if pending is not None else mx.zeros((batch, 0, self.width), dtype=self.dtype)
        counts = pending.counts if pending is not None else [0] * batch
        n, cache = features.shape[1], self.cache if rows is None else self.cache.subset(rows, block_size)
        lengths = cache.lengths
        if len(set(lengths)) == 1 and all(c == n for c in counts):
            at: tuple = (lengths[0], lengths[0] + n)
        else:  # rows at their own positions: context from each row's length, the block after its real entries
            at = (mx.array(lengths), mx.array([length + c for length, c in zip(lengths, counts)]))
        cache.reserve(n + block_size)
        # (quantized matmuls must not see an empty input: no new context, no projection)
        ctx = self.drafter.project_context(features) if n else mx.zeros((batch, 0, block.shape[2]), block.dtype)
        x = block
        for i, layer in enumerate(self.drafter.layers):
            x = layer(x, ctx, self.drafter.rope, at, cache, i, counts)
        cache.advance(counts)
        hidden = self.drafter.norm(x)[:, 1:]
        logits = scale_logits(self.head(hidden), *self.logit_scaling)
        if self.vocab_ids is not None:
            logits = spread(logits, self.vocab_ids, spec.vocab_size)
        if self.distribution:  # (DFlash2: its selector walks the candidates)
            assert spec.selector_top_k
            candidates, scores = self.drafter.candidate_selector.pair_scores(logits.astype(mx.float32), hidden,
                                                                             anchor_ids, spec.selector_top_k)
            draft = rules.selector_walk(MLXOps, anchor_ids, candidates, scores, draws, logits, top_k)
        else:
            draft = rules.choose(MLXOps, anchor_ids, logits, draws, top_k, _filtered)
        mx.async_eval(draft.ids)  # the draft runs while Python builds the verify graph
        return draft

    def crop(self, position: int) -> bool:
        return self.cache.crop(position)

    def reset(self) -> None:
        self.cache.reset()

    def state(self) -> list:
        return self.cache.state()

    # ---- rows --------------------------------------------------------------------------------------------------------
    def spawn(self) -> "MLXDraft":
        """The same weights with an empty context cache (a row prefilled alone, then merged)."""
        return MLXDraft(self.drafter, self.embed, self.lm_head, self.dtype, window=self.window,
                        logit_scaling=self.logit_scaling)

    def merge(self, other: "MLXDraft") -> None:
        self.cache.merge(other.cache)

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    def extract(self, row: int) -> "MLXDraft":
        """Row's context alone (a prefix kept after the row leaves the batch)."""
        out = self.spawn()
        out.cache = self.cache.extract(row)
        return out

    def cache_bytes(self) -> int:
        return self.cache.nbytes()
