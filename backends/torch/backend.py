"""PyTorch backend: a transformers target + a DFlash drafter behind the protocol of backends/base.py."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache, StaticCache

from dflash.errors import DFlashError
from dflash.sampling import SamplingParams
from dflash.spec import check_block_size

from ..base import crop_to_cached_prefix
from .drafter import DFlashDrafter, DraftCache, StaticDraftCache, extend_context, static_draft
from .rewind import CacheRewind, bounded_layers
from .sampling import TorchSampler
from .target import LayerCapture, target_info


class TorchBackend:
    name = "torch"

    def __init__(self, model, drafter: DFlashDrafter | None = None, block_size: int | None = None,
                 draft_window: int | None = None, prefill_chunk: int = 2048, cache_len: int | None = None,
                 compile: bool = False):
        self.model, self.drafter = model, drafter
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.info = target_info(model)
        self.prefill_chunk = prefill_chunk
        self.max_context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if drafter is None:
            self.block_size = 1
            self.capture = None
        else:
            spec = drafter.spec
            spec.validate_against(self.info)
            self.block_size = block_size or spec.block_size
            check_block_size(self.block_size, spec)
            self.capture = LayerCapture(model, spec.target_layer_ids)
            self.draft_cache = DraftCache(spec, self.dtype, self.device, window=draft_window)
            self._block = torch.full((1, self.block_size), spec.mask_token_id, dtype=torch.long, device=self.device)
        self._draft_fixed = None
        if compile and drafter is not None:
            # the drafter at fixed shapes too: a static context buffer as long as the target's, compiled once
            if cache_len is None or draft_window is not None:
                raise DFlashError("compile: the compiled drafter needs cache_len (a static cache) and no draft_window")
            self.draft_cache = StaticDraftCache(spec, self.dtype, self.device, cache_len + 2 * self.block_size)
            self._draft_rope = drafter.rope_range(0, self.draft_cache.capacity, self.draft_cache.k)
            self._draft_fixed = torch.compile(self._draft_proposals, dynamic=False, fullgraph=False,
                                              mode="reduce-overhead" if self.device.type == "cuda" else None)
        # cache_len: a preallocated StaticCache (fixed addresses, what torch.compile / CUDA graphs want); its crop
        # only moves the write position, and stale entries past it are masked by causality until overwritten
        self.cache_len = cache_len
        # targets with sliding-window or linear-attention layers (gpt-oss, Qwen3.5) rewind through CacheRewind
        self.rewind: CacheRewind | None = None
        self.cache = self._new_cache()
        # compile: the fixed-shape decode forwards (1 token, one block) go through torch.compile; prefill stays eager
        self._decode_model = model
        if compile:
            self._decode_model = torch.compile(model, dynamic=False, fullgraph=False,
                                               mode="reduce-overhead" if self.device.type == "cuda" else None)
        self.tokens: list[int] = []  # ids whose K/V is in the target cache
        self.pending: torch.Tensor | None = None  # target features not yet in the draft cache
        self.sampler = TorchSampler(SamplingParams(), self.device)

    # ---- protocol ------------------------------------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        self.sampler = TorchSampler(params, self.device)

    @property
    def cached_tokens(self) -> list[int]:
        return self.tokens

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> int:
        prompt_ids = list(prompt_ids)
        reuse = crop_to_cached_prefix(self, prompt_ids, self.max_context)
        logits = None
        for start in range(reuse, len(prompt_ids), self.prefill_chunk):
            chunk = torch.tensor([prompt_ids[start:start + self.prefill_chunk]], device=self.device)
            logits = self._forward(chunk, last_only=True)
            self.tokens.extend(prompt_ids[start:start + self.prefill_chunk])
            if self.drafter is not None:
                self._absorb_pending()
        return int(self.sampler(logits[0, -1:], self.tokens, None)[0])

    @torch.inference_mode()
    def draft(self, anchor: int) -> None:
        block = self._block if self.drafter is not None else None
        if block is None:
            self._verify_ids = torch.tensor([[anchor]], device=self.device)
            return
        block[0, 0] = anchor
        if self._draft_fixed is not None:
            features = self._take_pending()
            n = features.shape[1]
            self.draft_cache.reserve(n + self.block_size)
            features = torch.nn.functional.pad(features, (0, 0, 0, self.block_size - n))
            as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
            proposals = self._draft_fixed(block, features, as_tensor(self.draft_cache.position), as_tensor(n))
            self.draft_cache.advance(n)
        else:
            hidden = self.drafter.step(self.embed(block), self._take_pending(), self.draft_cache)
            proposals = self.lm_head(hidden[:, 1:]).argmax(dim=-1)
        self._verify_ids = torch.cat([block[:, :1], proposals], dim=1)

    def _draft_proposals(self, block, features, start, n):
        hidden = static_draft(self.drafter, self.embed(block), features, start, n, self.draft_cache, *self._draft_rope)
        return self.lm_head(hidden[:, 1:]).argmax(dim=-1)

    @torch.inference_mode()
    def verify(self) -> tuple[list[int], list[int]]:
        ids = self._verify_ids
        logits = self._forward(ids, last_only=False)
        target = self.sampler(logits[0], self.tokens, ids)
        out = torch.cat([ids[0], target]).tolist()  # the cycle's one device -> host read
        b = ids.shape[1]
        self._verified = out[:b]
        return out[1:b], out[b:]

    @torch.inference_mode()
    def commit(self, keep: int) -> None:
        extra = self._verify_ids.shape[1] - keep
        if extra > 0 and not self._crop_target(extra):
            raise AssertionError("a verified block can always be rewound")  # within the last forward
        self.tokens.extend(self._verified[:keep])
        if self.drafter is not None:
            self.pending = self._features[:, :keep]

    def crop(self, length: int) -> None:
        """Forget every position from `length` on, in the target cache and the draft context."""
        drop = len(self.tokens) - length
        if drop > 0:
            if not self._crop_target(drop):
                # sliding-window / recurrent state cannot go back past the last forward: start over (the next
                # prefill feeds the whole prompt again)
                self.reset()
                return
            del self.tokens[length:]
        if self.drafter is None:
            return
        have = self.draft_cache.position + (self.pending.shape[1] if self.pending is not None else 0)
        if length < self.draft_cache.position:
            self.pending = None
            if not self.draft_cache.crop(length):
                # the window dropped what we need: rebuild the whole context from scratch
                self.reset()
        elif self.pending is not None and length < have:
            self.pending = self.pending[:, : length - self.draft_cache.position]

    def _new_cache(self):
        if self.cache_len is None:
            cache = DynamicCache(config=self.model.config)
            if bounded_layers(cache):
                if self.rewind is None:
                    self.rewind = CacheRewind(self.model)
                self.rewind.attach(cache)
            return cache
        cache = StaticCache(config=self.model.config, max_cache_len=self.cache_len)
        if bounded_layers(cache):
            raise DFlashError(f"{self.info.model_type}: a static cache (cache_len / --compile) cannot rewind this "
                              "target's sliding-window or linear-attention layers; use the dynamic cache")
        return cache

    def _crop_target(self, n: int) -> bool:
        """Forget the last n positions of the target cache; False if its layers cannot go back that far."""
        if self.rewind is None:
            self.cache.crop(-n)
            return True
        return self.rewind.rewind(n)

    def reset(self) -> None:
        if self.cache_len is not None and self.tokens:
            self.cache.crop(-len(self.tokens))  # keep the static buffers (and any captured graphs) alive
        else:
            self.cache = self._new_cache()
        self.tokens = []
        self.pending = None
        if self.drafter is not None:
            self.draft_cache.reset()

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()
        if self.rewind is not None:
            self.rewind.remove()

    # ---- internals -----------------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        if self.cache_len is not None and len(self.tokens) + ids.shape[1] > self.cache_len:
            raise DFlashError(f"context: {len(self.tokens) + ids.shape[1]} tokens exceed the static cache "
                              f"({self.cache_len}); raise cache_len")
        model = self.model if last_only else self._decode_model
        if self.rewind is not None:
            self.rewind.before_forward()
        out = model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.rewind is not None:
            self.rewind.after_forward(ids.shape[1])
        if self.capture is not None:
            self._features = self.capture.pop()
            if last_only:
                self.pending = self._features if self.pending is None else torch.cat([self.pending, self._features], 1)
        return out.logits

    def _absorb_pending(self) -> None:
        extend_context(self.drafter, self._take_pending(), self.draft_cache)

    def _take_pending(self) -> torch.Tensor:
        feats = self.pending
        self.pending = None
        if feats is None:
            return torch.zeros(1, 0, self.drafter.fc.in_features, dtype=self.dtype, device=self.device)
        return feats
