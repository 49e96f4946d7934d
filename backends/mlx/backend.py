"""MLX backend: an mlx-lm target + a DFlash drafter behind the protocol of backends/base.py.

Everything stays lazy inside a cycle: the draft's proposals feed the verify forward as an array, and the only
device -> host read is the `tolist()` of the B drafted + B target ids at the end of verify().
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from dflash.errors import DFlashError
from dflash.sampling import SamplingParams
from dflash.spec import check_block_size

from ..base import crop_to_cached_prefix
from .drafter import DFlashDrafter, DraftCache
from .rewind import MLXRewind, needs_rewind
from .sampling import MLXSampler
from .target import TargetRunner, embedding, lm_head, target_info


class MLXBackend:
    name = "mlx"

    def __init__(self, model, config: dict, drafter: DFlashDrafter | None = None, block_size: int | None = None,
                 draft_window: int | None = None, prefill_chunk: int = 2048):
        self.model, self.config, self.drafter = model, config, drafter
        self.info = target_info(model, config)
        self.embed, self.lm_head = embedding(model), lm_head(model)
        self.dtype = self.embed(mx.array([[0]])).dtype
        self.prefill_chunk = prefill_chunk
        self.max_context = config.get("text_config", config).get("max_position_embeddings")
        if drafter is None:
            self.block_size = 1
            self.runner = TargetRunner(model, config)
        else:
            spec = drafter.spec
            spec.validate_against(self.info)
            self.block_size = block_size or spec.block_size
            check_block_size(self.block_size, spec)
            self.runner = TargetRunner(model, config, spec.target_layer_ids)
            self.draft_cache = DraftCache(spec, self.dtype, window=draft_window)
            # slots 1..B-1 of every block are the mask token: embed them once (for any block size up to the trained)
            self._mask_embeds = self.embed(mx.full((1, spec.block_size - 1), spec.mask_token_id, dtype=mx.int32))
            self._context_width = spec.hidden_size * spec.num_context_layers
            mx.eval(self._mask_embeds)
        self.rewind: MLXRewind | None = None  # sliding-window / linear-attention targets (gpt-oss, Qwen3.5)
        self.cache = self._new_cache()
        self.tokens: list[int] = []  # ids whose K/V is in the target cache
        self.pending: mx.array | None = None  # target features not yet in the draft cache
        self.sampler = MLXSampler(SamplingParams())

    # ---- protocol ------------------------------------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        self.sampler = MLXSampler(params)

    @property
    def cached_tokens(self) -> list[int]:
        return self.tokens

    def prefill(self, prompt_ids: Sequence[int]) -> int:
        prompt_ids = list(prompt_ids)
        reuse = crop_to_cached_prefix(self, prompt_ids, self.max_context)
        logits = None
        for start in range(reuse, len(prompt_ids), self.prefill_chunk):
            chunk = prompt_ids[start:start + self.prefill_chunk]
            logits = self._forward(mx.array([chunk], dtype=mx.int32), last_only=True)
            self.tokens.extend(chunk)
            if self.drafter is not None:
                self.drafter.extend_context(self._take_pending(), self.draft_cache)
            if start + self.prefill_chunk < len(prompt_ids):
                mx.eval(self._state())  # bound the graph (and its memory) chunk by chunk
        first = self.sampler(logits[0, -1:], self.tokens, None)
        mx.eval(first, self._state())
        return int(first.item())

    def draft(self, anchor: int) -> None:
        anchor_ids = mx.array([[anchor]], dtype=mx.int32)
        if self.drafter is None:
            self._verify_ids = anchor_ids
            return
        block = mx.concatenate([self.embed(anchor_ids), self._mask_embeds[:, : self.block_size - 1]], axis=1)
        hidden = self.drafter.step(block, self._take_pending(), self.draft_cache)
        proposals = mx.argmax(self.lm_head(hidden[:, 1:]), axis=-1).astype(mx.int32)
        self._verify_ids = mx.concatenate([anchor_ids, proposals], axis=1)
        mx.async_eval(self._verify_ids)  # the draft runs while Python builds the verify graph

    def verify(self) -> tuple[list[int], list[int]]:
        ids = self._verify_ids
        logits = self._forward(ids, last_only=False)
        target = self.sampler(logits[0], self.tokens, ids[0])
        out = mx.concatenate([ids[0], target.astype(mx.int32)]).tolist()  # the cycle's one device -> host read
        b = ids.shape[1]
        self._verified = out[:b]
        return out[1:b], out[b:]

    def commit(self, keep: int) -> None:
        extra = self._verify_ids.shape[1] - keep
        if extra > 0 and not self._trim(extra):
            raise AssertionError("a verified block can always be rewound")  # within the last forward
        self.tokens.extend(self._verified[:keep])
        if self.drafter is not None:
            self.pending = self._features[:, :keep]

    def crop(self, length: int) -> None:
        """Forget every position from `length` on, in the target cache and the draft context."""
        drop = len(self.tokens) - length
        if drop > 0:
            if not self._trim(drop):
                self.reset()  # sliding-window / recurrent state cannot go back past the last forward: start over
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

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.tokens = []
        self.pending = None
        if self.drafter is not None:
            self.draft_cache.reset()

    def close(self) -> None:
        pass

    # ---- internals -----------------------------------------------------------------------------------------------
    def _new_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        if needs_rewind(cache):
            if self.rewind is None:
                self.rewind = MLXRewind(self.runner.layers, cache)
            self.rewind.attach(cache)
            return cache
        if not can_trim_prompt_cache(cache):
            raise DFlashError(f"{self.info.model_type}: this target's mlx-lm cache cannot be rewound (recurrent or "
                              "rotating layers), which speculative decoding needs")
        return cache

    def _trim(self, n: int) -> bool:
        """Forget the last n target positions; False if the cache cannot go back that far (see rewind.py)."""
        if self.rewind is not None:
            return self.rewind.rewind(n)
        # a rotating cache stops being trimmable once it wraps; rewinding it silently would corrupt the output
        if trim_prompt_cache(self.cache, n) != n:
            raise DFlashError(f"{self.info.model_type}: the target's mlx-lm cache could not be rewound by {n} "
                              "positions (a rotating/sliding cache that already wrapped)")
        return True

    def _forward(self, ids: mx.array, last_only: bool) -> mx.array:
        if self.rewind is None:
            logits, feats = self.runner(ids, self.cache, last_only)
        else:
            self.rewind.before_forward()
            with self.rewind.recording():
                logits, feats = self.runner(ids, self.cache, last_only)
            self.rewind.after_forward(ids.shape[1])
        if self.drafter is not None:
            self._features = feats
            if last_only:
                self.pending = feats if self.pending is None else mx.concatenate([self.pending, feats], axis=1)
        return logits

    def _take_pending(self) -> mx.array:
        feats = self.pending
        self.pending = None
        if feats is None:
            return mx.zeros((1, 0, self._context_width), dtype=self.dtype)
        return feats

    def _state(self) -> list:
        state = [c.state for c in self.cache]
        if self.drafter is not None:
            state += self.draft_cache.state()
        return state
