"""Batched speculative decoding: several sequences share every draft and verify forward, each accepting its own
prefix (the BatchBackend protocol of backends/base.py, driven by dflash.loop.generate_batch).

Rows advance at different rates. A cycle keeps its block's first max(keep) slots in the target cache for every
row and masks the slots a row did not accept ("holes"), exactly like the left padding of the prompts. Each row's
tokens carry their true positions (explicit position_ids), so its attention and RoPE see what batch-1 decoding
sees and its greedy output is batch-1's. When holes fill half the cache, the valid slots are gathered to the right
(compaction). The drafter's context cache follows the same scheme.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dflash.errors import DFlashError
from dflash.sampling import SamplingParams

from ..base import check_fits
from .rewind import bounded_layers
from .sampling import TorchSampler


def _right_aligned(valid: torch.Tensor) -> torch.Tensor:
    """Per row, the slot indices that gather its valid slots (in order) to the right end of a narrower buffer."""
    width = int(valid.sum(1).max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # invalid first, both in slot order
    return order[:, order.shape[1] - width:]


class BatchDraftCache:
    """The drafter's context K/V for a batch: (layers, batch, kv_heads, capacity, head_dim) buffers plus a
    validity mask; positions are baked into the keys by RoPE, so slots need not be contiguous per row."""

    def __init__(self, spec, batch: int, dtype, device, capacity: int = 256):
        shape = (spec.num_hidden_layers, batch, spec.num_key_value_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.used = 0

    def reserve(self, n: int) -> None:
        if self.used + n > self.k.shape[3]:
            size = max(self.used + n, 2 * self.k.shape[3])
            pad = size - self.k.shape[3]
            self.k = F.pad(self.k, (0, 0, 0, pad))
            self.v = F.pad(self.v, (0, 0, 0, pad))
            self.valid = F.pad(self.valid, (0, pad))

    def select(self, rows: torch.Tensor) -> None:
        self.k, self.v, self.valid = self.k[:, rows], self.v[:, rows], self.valid[rows]

    def compact(self) -> None:
        idx = _right_aligned(self.valid[:, :self.used])
        n, width = idx.shape
        gather = idx[None, :, None, :, None].expand(self.k.shape[0], n, self.k.shape[2], width, self.k.shape[4])
        self.k[:, :, :, :width] = self.k[:, :, :, :self.used].gather(3, gather)
        self.v[:, :, :, :width] = self.v[:, :, :, :self.used].gather(3, gather)
        self.valid[:, :width] = self.valid[:, :self.used].gather(1, idx)
        self.valid[:, width:] = False
        self.used = width


class BatchedTorchBackend:
    name = "torch"

    def __init__(self, model, drafter=None, capture=None, block_size: int = 1):
        self.model, self.drafter, self.capture = model, drafter, capture
        self.block_size = block_size if drafter is not None else 1
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.max_context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.additive_mask = model.config._attn_implementation == "eager"
        if bounded_layers(DynamicCache(config=model.config)):
            raise DFlashError("--batch-size: batched decoding needs a full-attention target (this one has "
                              "sliding-window or linear-attention layers); use --batch-size 1")
        if drafter is not None and any(drafter.spec.window_for_layer(i) is not None
                                       for i in range(drafter.spec.num_hidden_layers)):
            raise DFlashError("--batch-size: batched decoding does not support drafters with sliding-window "
                              "layers yet; use --batch-size 1")
        self.sampler = TorchSampler(SamplingParams(), self.device)

    @classmethod
    def from_backend(cls, backend) -> "BatchedTorchBackend":
        """Share a TorchBackend's target, drafter and feature hooks (no second copy of any weight)."""
        if backend.cache_len is not None:
            raise DFlashError("--batch-size: batched decoding runs on the dynamic cache; drop --compile / cache_len")
        return cls(backend.model, backend.drafter, backend.capture, backend.block_size)

    # ---- protocol ------------------------------------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        self.sampler = TorchSampler(params, self.device)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        for p in prompts:  # (empty prompts are refused by dflash.loop before any backend call)
            check_fits(p, self.max_context)
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(n, width, dtype=torch.long)
        valid = torch.zeros(n, width, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is in the last column
            ids[i, width - len(p):] = torch.tensor(list(p))
            valid[i, width - len(p):] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        self.valid = torch.zeros(n, 0, dtype=torch.bool, device=self.device)  # slots of the target cache in use
        self.length = valid.sum(1)  # real tokens per row = position of its next token
        self.history = [list(p) for p in prompts]  # what the logits processors see (repetition penalty)
        logits, features = self._forward(ids, positions, valid, last_only=True)
        self.valid = valid
        if self.drafter is not None:
            self.draft_cache = BatchDraftCache(self.drafter.spec, n, self.dtype, self.device,
                                               capacity=width + 8 * self.block_size)
            self.pending = (features, valid, positions)
        return [int(self.sampler(logits[i, -1:], self.history[i], None)[0]) for i in range(n)]

    @torch.inference_mode()
    def draft(self, anchors: Sequence[int]) -> None:
        anchor = torch.tensor(list(anchors), device=self.device)[:, None]
        if self.drafter is None:
            self._verify_ids = anchor
            return
        n, b = anchor.shape[0], self.block_size
        block = torch.cat([anchor, anchor.new_full((n, b - 1), self.drafter.spec.mask_token_id)], dim=1)
        hidden = self._draft_forward(self.embed(block))
        self._verify_ids = torch.cat([anchor, self.lm_head(hidden[:, 1:]).argmax(dim=-1)], dim=1)

    @torch.inference_mode()
    def verify(self) -> tuple[list[list[int]], list[list[int]]]:
        ids = self._verify_ids
        n, b = ids.shape
        positions = self.length[:, None] + torch.arange(b, device=self.device)
        logits, self._features = self._forward(ids, positions, torch.ones_like(ids, dtype=torch.bool),
                                                last_only=False)
        if self.sampler.params.greedy and not self.sampler.processors:
            target = logits.argmax(dim=-1)
        else:
            target = torch.stack([self.sampler(logits[i], self.history[i], ids[i]) for i in range(n)])
        rows = torch.cat([ids, target], dim=1).tolist()  # the cycle's one device -> host read
        self._verified = [r[:b] for r in rows]
        return [r[1:b] for r in rows], [r[b:] for r in rows]

    @torch.inference_mode()
    def commit(self, keeps: Sequence[int]) -> None:
        b, most = self._verify_ids.shape[1], max(keeps)
        if most < b:
            self.cache.crop(-(b - most))
        slot = torch.arange(most, device=self.device)
        kept = slot[None] < torch.tensor(list(keeps), device=self.device)[:, None]
        positions = self.length[:, None] + slot
        self.valid = torch.cat([self.valid, kept], dim=1)
        self.length = self.length + kept.sum(1)
        for hist, verified, k in zip(self.history, self._verified, keeps):
            hist.extend(verified[:k])
        if self.drafter is not None:
            self.pending = (self._features[:, :most], kept, positions)
        holes = self.valid.numel() - int(self.length.sum())
        if self.valid.shape[1] > 64 and 2 * holes > self.valid.numel():
            self._compact()

    @torch.inference_mode()
    def retire(self, rows: Sequence[int]) -> None:
        gone = set(rows)
        keep = [i for i in range(self.valid.shape[0]) if i not in gone]
        if not keep:
            self.cache = None
            return
        idx = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(idx)
        self.valid, self.length = self.valid[idx], self.length[idx]
        self.history = [self.history[i] for i in keep]
        if self.drafter is not None:
            self.draft_cache.select(idx)
            self.pending = tuple(t[idx] for t in self.pending)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _forward(self, ids, positions, new_valid, last_only: bool):
        """Target forward of `ids` (n, T) at `positions`, attending to the valid cached slots and causally to the
        new ones; returns logits and the captured features."""
        keys = torch.cat([self.valid, new_valid], dim=1)
        total, t = keys.shape[1], ids.shape[1]
        q = torch.arange(total - t, total, device=self.device)[:, None]
        k = torch.arange(total, device=self.device)[None]
        # padding queries see themselves, so no softmax row is empty (an all-masked row would be NaN)
        mask = ((keys[:, None, :] & (k <= q)) | (k == q))[:, None]
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(self.dtype).min)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1 if last_only else 0)
        features = self.capture.pop() if self.capture is not None else None
        return out.logits, features

    def _draft_forward(self, block: torch.Tensor) -> torch.Tensor:
        """The drafter on the embedded block (n, B, H): absorbs the pending context, attends to every valid context
        slot plus the whole block (not causal), and forgets the block's K/V afterwards."""
        drafter, cache = self.drafter, self.draft_cache
        features, fvalid, fpositions = self.pending
        m, b = features.shape[1], block.shape[1]
        start = cache.used
        cache.reserve(m + b)
        cache.valid[:, start:start + m] = fvalid
        cache.valid[:, start + m:start + m + b] = True
        end = start + m + b
        mask = cache.valid[:, None, None, :end]
        positions = torch.cat([fpositions, self.length[:, None] + torch.arange(b, device=self.device)], dim=1)
        cos, sin = drafter.rope(positions, block)
        rope_q = (cos[:, :, m:], sin[:, :, m:])

        def attend(i, q, k, v):
            cache.k[i, :, :, start:end] = k
            cache.v[i, :, :, start:end] = v
            return F.scaled_dot_product_attention(q, cache.k[i, :, :, :end], cache.v[i, :, :, :end], attn_mask=mask,
                                                  enable_gqa=True)

        hidden = drafter(block, drafter.project_context(features), rope_q, (cos, sin), attend)
        cache.valid[:, start + m:end] = False
        cache.used = start + m
        self.pending = None
        return hidden

    def _compact(self) -> None:
        idx = _right_aligned(self.valid)
        for layer in self.cache.layers:
            gather = idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        self.valid = self.valid.gather(1, idx)
        if self.drafter is not None:
            self.draft_cache.compact()
