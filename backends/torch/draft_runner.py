"""The drafter's primitives for dflash.core.engine on torch: absorb context, propose a block, rewind, batch rows.

A draft forward embeds [anchor, mask x (B-1)] for every row, runs the drafter over the row's context cache and
returns the proposals by each row's rule (dflash.core.rules: the argmax of the draft logits, a sample, or for
DFlash2 the candidate selector's walk), plus, when asked, the per-position top-k ids and probabilities (on the
device: the engine reads nothing back here).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList

from dflash.core import rules
from dflash.core.contract import Draft, Pending
from dflash.core.errors import DFlashError
from dflash.core.sampling import RowDraw

from .draft_cache import BlockOnlyContext, DraftContextCache, StaticDraftCache
from .drafter import DFlashDrafter, DraftAttention, rotate, scale_logits, spread
from .kv_cache import attention_window
from .ops import TorchOps
from .sampling import warpers


def extend_context(model: DFlashDrafter, features: torch.Tensor, cache: DraftContextCache,
                   counts: list[int] | None = None) -> None:
    """Append context K/V without drafting (prefill, or a cycle without a draft forward); row i's first counts[i]
    features are real (default: all). Context K/V depends only on the features, not on the block or on earlier
    layers' outputs, so a long prompt is absorbed chunk by chunk with projections alone."""
    n = features.shape[1]
    if n == 0:
        return
    cache.reserve(n)
    ctx = model.project_context(features)
    b = ctx.shape[0]
    counts = [n] * b if counts is None else counts
    lengths = cache.lengths
    if len(set(lengths)) == 1:
        cos, sin = model.rope_range(lengths[0], n, ctx)
    else:  # rows at different lengths: each row's entries at its own positions
        positions = torch.tensor(lengths, device=ctx.device)[:, None] + torch.arange(n, device=ctx.device)
        cos, sin = model.rope(positions, ctx)
    for i, layer in enumerate(model.layers):
        attn = cast(DraftAttention, layer.self_attn)  # (torch types a submodule Tensor | Module)
        k = attn.k_norm(attn.k_proj(ctx).view(b, n, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(ctx).view(b, n, -1, attn.head_dim).transpose(1, 2)
        cache.write(i, rotate(k, cos, sin), v, counts, 0)
    cache.advance(counts)


def draft_step(model: DFlashDrafter, block: torch.Tensor, features: torch.Tensor, counts: list[int],
               cache: DraftContextCache) -> torch.Tensor:
    """One draft forward: append `features` (rows, m, K*H; row i's first counts[i] are real) to the cache, run the
    embedded blocks (rows, B, H) that follow each row's context, and return their final-normed states. The block's
    K/V is written past each row's context and forgotten (only the context advances)."""
    m, b = features.shape[1], block.shape[1]
    cache.reserve(m + b)
    ctx = model.project_context(features)
    lengths = cache.lengths
    if len(set(lengths)) == 1 and all(c == m for c in counts):
        rope_kv = model.rope_range(lengths[0], m + b, block)
    else:
        device = block.device
        length = torch.tensor(lengths, device=device)[:, None]
        anchor = length + torch.tensor(counts, device=device)[:, None]
        positions = torch.cat([length + torch.arange(m, device=device), anchor + torch.arange(b, device=device)], 1)
        rope_kv = model.rope(positions, block)
    rope_q = (rope_kv[0][:, :, m:], rope_kv[1][:, :, m:])

    def attend(i, q, k, v):
        k, v, mask = cache.write(i, k, v, counts, b)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    out = model(block, ctx, rope_q, rope_kv, attend)
    cache.advance(counts)
    return out


def absorb_block_only(model: DFlashDrafter, features: torch.Tensor, counts: list[int],
                      context: BlockOnlyContext) -> None:
    """extend_context of an ablation drafter (context_mode none / input): advance each row's position, keeping input
    fusion's projected features; there is no context K/V."""
    context.reserve(features.shape[1])
    if context.features is not None and features.shape[1]:
        context.write(model.project_context(features), counts)
    context.advance(counts)


def block_step(model: DFlashDrafter, block: torch.Tensor, features: torch.Tensor, counts: list[int],
               context: BlockOnlyContext) -> torch.Tensor:
    """draft_step of an ablation drafter: attention over the block alone, at the same absolute positions as
    DFlash's; input fusion adds the projected feature of the position before the anchor to every slot."""
    absorb_block_only(model, features, counts, context)
    anchors = torch.tensor(context.lengths, device=block.device)[:, None]
    rope = model.rope(anchors + torch.arange(block.shape[1], device=block.device), block)
    fused = None if context.features is None else model.fused_input(context.features, anchors, block.shape[1])
    attend = lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    return model(block, block[:, :0], rope, rope, attend, fused)


def static_draft(model: DFlashDrafter, block: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
                 n: torch.Tensor, cache: StaticDraftCache, cos: torch.Tensor, sin: torch.Tensor,
                 window: int) -> torch.Tensor:
    """One draft forward at fixed shapes (compile it once): `features` (1, B, K*H) holds the n new context
    positions padded to B, written at slots start..; the embedded block (1, B, H) goes at start + n.., over the
    padding. `start` and `n` are 0-d device tensors and cos/sin the RoPE table of every slot, so nothing here
    depends on a host value but `window`, the slots attended over (a bucket that covers start + n + B: attending
    over the whole buffer costs more than the drafter's matmuls on a CPU)."""
    b = block.shape[1]
    k_cache, v_cache = cache.k, cache.v
    arange = torch.arange(b, device=block.device)
    ctx_slots, block_slots = start + arange, start + n + arange
    slots = torch.cat([ctx_slots, block_slots])
    rope_kv = (cos[:, :, slots], sin[:, :, slots])
    rope_q = (rope_kv[0][:, :, b:], rope_kv[1][:, :, b:])

    # one write per buffer: slot start + j takes the context's entry j (j < n), then the block's; indices past the
    # block repeat its last slot and entry. (Two writes to one buffer, the block's over the context's padding, each
    # through a view of it, made the compiled graph copy every buffer whole: 10.8 ms a draft on a CPU, now 2.4)
    j = torch.minimum(torch.arange(2 * b, device=block.device), n + b - 1)
    source, written = torch.where(j < n, j, j - n + b), start + j

    def attend(i, q, k, v):
        cache.put(i, written, k.index_select(2, source), v.index_select(2, source))
        mask = cache.static_mask(i, start, n, b, window)
        return F.scaled_dot_product_attention(q, k_cache[i][:, :, :window], v_cache[i][:, :, :window],
                                              attn_mask=mask, enable_gqa=True)

    return model(block, model.project_context(features), rope_q, rope_kv, attend)


def _filtered(params, logits: torch.Tensor) -> torch.Tensor:
    """One row's draft logits (P, V) under the row's sampling filters (transformers' warpers)."""
    # transformers types input_ids a LongTensor; warpers never read it
    return LogitsProcessorList(warpers(params))(None, logits.float())  # type: ignore[arg-type]


class TorchDraft:
    """A DFlash drafter and its context cache, sharing the target's embedding and LM head (or, with a draft
    vocabulary, scoring with its own head over those tokens and spreading the logits over the target's ids)."""

    def __init__(self, drafter: DFlashDrafter, embed, lm_head, *, window: int | None = None,
                 static_capacity: int | None = None, logit_scaling: tuple[float, float | None] = (1.0, None)):
        self.drafter, self.embed, self.lm_head, self.window = drafter, embed, lm_head, window
        spec = drafter.spec
        self.head = drafter.lm_head if spec.has_draft_vocab else lm_head
        self.vocab_ids = drafter.target_ids() if spec.has_draft_vocab else None
        self.logit_scaling = logit_scaling  # (multiplier, softcap): DraftSpec.logit_scaling
        self.spec = spec
        self.distribution = spec.is_dflash2  # the selector's q_t: a draft distribution of its own
        weight = embed.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.width = spec.hidden_size * spec.num_context_layers
        self._compiled = None
        if not spec.context_kv:
            if static_capacity is not None:
                raise DFlashError(f"compile: dflash_config.context_mode {spec.context_mode!r} (an ablation drafter) "
                                  "runs on the dynamic path only; drop --compile / cache_len")
            self.cache: BlockOnlyContext | DraftContextCache = BlockOnlyContext(spec, self.dtype, self.device)
        elif static_capacity is None:
            self.cache = DraftContextCache(spec, self.dtype, self.device, window=window)
        else:
            # the drafter at fixed shapes too: a static context buffer as long as the target's, compiled once
            static = self.cache = StaticDraftCache(spec, self.dtype, self.device, static_capacity)
            self._rope = drafter.rope_range(0, static.capacity, static.k)
            # dynamic=None: the window is specialised once, then compiled as a symbol (one more graph, not one per
            # window)
            self._compiled = torch.compile(self._static_forward, dynamic=None, fullgraph=True,
                                           mode="reduce-overhead" if self.device.type == "cuda" else None)

    @property
    def position(self) -> int:
        return self.cache.position

    def spawn(self) -> "TorchDraft":
        """The same weights with an empty context cache (a row prefilled alone, then merged)."""
        return TorchDraft(self.drafter, self.embed, self.lm_head, window=self.window, logit_scaling=self.logit_scaling)

    @torch.inference_mode()
    def extend(self, pending: Pending | None) -> None:
        if pending is None:
            return
        if isinstance(self.cache, BlockOnlyContext):
            absorb_block_only(self.drafter, pending.features, pending.counts, self.cache)
        else:
            extend_context(self.drafter, pending.features, self.cache, pending.counts)

    @property
    def drafts_some_rows(self) -> bool:
        """propose(rows=...): on the growing context cache (the static one drafts one row)."""
        return type(self.cache) is DraftContextCache

    @torch.inference_mode()
    def propose(self, anchor_ids: torch.Tensor, pending: Pending | None, block_size: int, top_k: int = 0,
                draws: list[RowDraw] | None = None, rows: list[int] | None = None) -> Draft:
        batch = anchor_ids.shape[0]
        mask_id = self.drafter.spec.mask_token_id
        block = torch.cat([anchor_ids, anchor_ids.new_full((batch, block_size - 1), mask_id)], dim=1)
        if pending is None:
            pending = Pending(torch.zeros(batch, 0, self.width, dtype=self.dtype, device=self.device), [0] * batch)
        if rows is not None and (pending.features.shape[1] or draws is not None or not self.drafts_some_rows):
            raise DFlashError("propose(rows=...): greedy rows of a growing context cache, absorbed (extend) first")
        if self._compiled is not None:
            features = pending.features
            n = features.shape[1]
            self.cache.reserve(n + block_size)
            features = F.pad(features, (0, 0, 0, block_size - n))
            as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
            window = attention_window(self.cache.position + n + block_size, self.cache.capacity)
            logits, hidden = self._compiled(block, features, as_tensor(self.cache.position), as_tensor(n), window)
            self.cache.advance([n])
        else:
            cache = self.cache
            if rows is not None:  # some rows: their context copied out, their blocks written there and forgotten
                assert isinstance(cache, DraftContextCache)  # (drafts_some_rows)
                cache = cache.subset(rows, block_size)
            args = (self.drafter, self.embed_block(block), pending.features, pending.counts)
            hidden = (block_step(*args, cache) if isinstance(cache, BlockOnlyContext)
                      else draft_step(*args, cache))[:, 1:]
            logits = self.logits(hidden)
        spec = self.drafter.spec
        if self.distribution:  # (DFlash2: its selector walks the candidates)
            assert spec.selector_top_k
            candidates, scores = self.drafter.candidate_selector.pair_scores(logits.float(), hidden, anchor_ids,
                                                                             spec.selector_top_k)
            return rules.selector_walk(TorchOps, anchor_ids, candidates, scores, draws, logits, top_k)
        return rules.choose(TorchOps, anchor_ids, logits, draws, top_k, _filtered)

    def embed_block(self, block: torch.Tensor) -> torch.Tensor:
        x = self.embed(block)
        scale = self.drafter.spec.input_embedding_scale
        return x if scale is None else x * scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # (rows * positions, H) in one matrix product: the block's slice of the drafter's states is not contiguous,
        # and a 3D slice through the LM head runs as a batched product over one copy of the head per row (4x
        # slower on a CPU at 8 rows)
        flat = scale_logits(self.head(hidden.reshape(-1, hidden.shape[-1])), *self.logit_scaling)
        if self.vocab_ids is not None:
            flat = spread(flat, self.vocab_ids, self.spec.vocab_size)
        return flat.view(*hidden.shape[:-1], -1)

    def _static_forward(self, block, features, start, n, window: int):
        assert isinstance(self.cache, StaticDraftCache)  # (static_capacity set: the compiled path's buffers)
        hidden = static_draft(self.drafter, self.embed_block(block), features, start, n, self.cache, *self._rope,
                              window=window)
        return self.logits(hidden[:, 1:]), hidden[:, 1:]

    # Every method that writes the context cache runs in inference mode: a buffer grown inside a draft forward is an
    # inference tensor, and an in-place write to one outside the mode raises (a row joining or leaving a server batch).
    @torch.inference_mode()
    def crop(self, position: int) -> bool:
        return self.cache.crop(position)

    @torch.inference_mode()
    def reset(self) -> None:
        self.cache.reset()

    def state(self) -> list:
        return []  # eager: nothing for Target.settle to evaluate

    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    @torch.inference_mode()
    def merge(self, other: "TorchDraft") -> None:
        self.cache.merge(cast(Any, other.cache))  # (the same kind as this one's: both from the drafter's spec)

    @torch.inference_mode()
    def extract(self, i: int) -> "TorchDraft":
        """Row i's context alone (a prefix kept after the row leaves the batch)."""
        if self._compiled is not None or self.window is not None:
            raise DFlashError("prefix cache: a compiled or windowed draft context is not kept across requests")
        row = self.spawn()
        row.cache = self.cache.extract(i)
        return row

    def cache_bytes(self) -> int:
        return self.cache.nbytes
