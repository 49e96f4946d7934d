"""Drawing the target's token at each verified position with mlx-lm's own samplers and logits processors.

Row i of a verified block is processed with the history it would have in target-only decoding: the committed tokens
plus block[0..i]. The repetition penalty sees the whole history (mlx-lm defaults to the last 20 tokens; the torch
backend, like transformers, uses all of them). mlx-lm's sampler applies top-p / min-p / top-k to the log-probs and
the temperature last, inside the categorical draw (transformers applies the temperature first): with a temperature
other than 1 the two backends filter slightly different sets, each exactly as its own library does.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from dflash.sampling import SamplingParams

_WHOLE_HISTORY = 2**31 - 1  # slice bounds must fit int32


class MLXSampler:
    def __init__(self, params: SamplingParams):
        p = self.params = params
        self.processors = []
        if p.repetition_penalty != 1.0:
            self.processors = make_logits_processors(repetition_penalty=p.repetition_penalty,
                                                     repetition_context_size=_WHOLE_HISTORY)
        self.sampler = None
        if not p.greedy:
            self.sampler = make_sampler(temp=p.temperature, top_p=p.top_p if p.top_p < 1.0 else 0.0,
                                        min_p=p.min_p, top_k=p.top_k)
            if p.seed is not None:
                mx.random.seed(p.seed)  # mlx-lm's samplers draw from the global generator

    def __call__(self, logits: mx.array, history: list[int], block: mx.array | None,
                 paths: list[list[int]] | None = None) -> mx.array:
        """logits (T, V) for the T positions that follow history + block[:i+1] (a tree: history + paths[i]);
        returns T token ids (lazy)."""
        return self.draw(self.processed(logits, history, block, paths))

    def processed(self, logits: mx.array, history: list[int], block: mx.array | None,
                  paths: list[list[int]] | None = None) -> mx.array:
        """The logits after the logits processors (the repetition penalty)."""
        if not self.processors:
            return logits
        hist = mx.array(history, dtype=mx.int32)
        rows = []
        for i in range(logits.shape[0]):
            if paths is not None:
                tokens = mx.array(history + paths[i], dtype=mx.int32)
            else:
                tokens = hist if block is None else mx.concatenate([hist, block[: i + 1].astype(mx.int32)])
            row = logits[i:i + 1].astype(mx.float32)
            for proc in self.processors:
                row = proc(tokens, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def draw(self, logits: mx.array) -> mx.array:
        if self.sampler is None:
            return mx.argmax(logits, axis=-1)
        logits = logits.astype(mx.float32)
        return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def log_probs(self, logits: mx.array, tokens: mx.array, top: int):
        """(chosen, top ids, top log-probs) of the tempered distribution (mlx-lm filters top-p / top-k / min-p
        inside its sampler, so these are before that filtering)."""
        x = logits.astype(mx.float32)
        if self.sampler is not None and self.params.temperature != 1.0:
            x = x / self.params.temperature
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1).squeeze(-1)
        ids = mx.argsort(-lp, axis=-1)[..., :top]
        return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)
