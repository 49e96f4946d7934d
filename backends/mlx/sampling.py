"""Drawing the target's token at each verified position with mlx-lm's own samplers and logits processors.

Row i of a verified block is processed with the history it would have in target-only decoding: the committed tokens
plus block[0..i]. The repetition penalty sees the whole history (mlx-lm defaults to the last 20 tokens; the torch
backend, like transformers, uses all of them). mlx-lm's sampler applies top-p / min-p / top-k to the log-probs and
the temperature last, inside the categorical draw (transformers applies the temperature first): with a temperature
other than 1 the two backends filter slightly different sets, each exactly as its own library does.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from dflash.core.sampling import SamplingParams

_WHOLE_HISTORY = 2**31 - 1  # slice bounds must fit int32


class MLXSampler:
    """One row's processors and filters. Its draws take their noise from the engine (dflash.core.sampling: noise tied to
    positions): the target's token is argmax(filtered log-weights + Gumbel noise), an exact sample of them."""

    def __init__(self, params: SamplingParams):
        p = self.params = params
        self.processors = []
        if p.repetition_penalty != 1.0:
            self.processors = make_logits_processors(repetition_penalty=p.repetition_penalty,
                                                     repetition_context_size=_WHOLE_HISTORY)

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

    def draw(self, logits: mx.array, gumbel: mx.array | None) -> mx.array:
        if gumbel is None:
            return mx.argmax(logits, axis=-1)
        return mx.argmax(self.filtered(logits) + gumbel, axis=-1)

    def filtered(self, logits: mx.array) -> mx.array:
        """Processed logits (T, V) -> the log-weights the sampler's categorical draws from: mlx-lm's filters on the
        log-probs, then the temperature (its order); greedy: the log-probs."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        p = self.params
        if p.greedy:
            return logprobs
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k:
            logprobs = apply_top_k(logprobs, p.top_k)
        return logprobs / p.temperature

    def probabilities(self, processed: mx.array) -> mx.array:
        """The distribution (T, V) the sampler draws from, given processed logits."""
        return mx.softmax(self.filtered(processed), axis=-1)

    def log_probs(self, logits: mx.array, tokens: mx.array, top: int):
        """(chosen, top ids, top log-probs) of the distribution the tokens were drawn from (processed logits in:
        mlx-lm's filters and the temperature applied here as its sampler applies them)."""
        x = self.filtered(logits)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1).squeeze(-1)
        ids = mx.argsort(-lp, axis=-1)[..., :top]
        return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)


def gumbel(keys: list[int], vocab: int) -> mx.array:
    """(len(keys), vocab) standard Gumbel noise, row j drawn with the key keys[j] alone."""
    return mx.stack([mx.random.gumbel(shape=(vocab,), key=mx.random.key(k)) for k in keys])


def inverse_cdf(probs: mx.array, u: mx.array) -> mx.array:
    """One draw per row of probs (..., V) (not necessarily normalised) from its uniform u (...,)."""
    cdf = mx.cumsum(probs, axis=-1)
    index = (cdf < (u * cdf[..., -1])[..., None]).sum(axis=-1)
    return mx.minimum(index, probs.shape[-1] - 1).astype(mx.int32)


def rejection_tokens(p: mx.array, drafted: mx.array, q_ids: mx.array, q_probs: mx.array, accept_u: mx.array,
                     residual_u: mx.array, bonus: mx.array) -> mx.array:
    """p (B, V), drafted (B-1,) sampled from the sparse q (B-1, k over q_ids): keep drafted[i] when
    accept_u[i] * q <= p, else draw from max(0, p - q) normalised with residual_u[i]; `bonus` is the target's own
    draw at the last position (backends/torch/sampling.py: the same)."""
    drafted = drafted.astype(mx.int32)
    q = mx.put_along_axis(mx.zeros_like(p[:-1]), q_ids.astype(mx.int32), q_probs.astype(p.dtype), axis=1)
    px = mx.take_along_axis(p[:-1], drafted[:, None], axis=1)[:, 0]
    qx = mx.take_along_axis(q, drafted[:, None], axis=1)[:, 0]
    accept = accept_u * qx <= px
    residual = mx.maximum(p[:-1] - q, 0.0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[:-1])
    redrawn = inverse_cdf(residual, residual_u)
    return mx.concatenate([mx.where(accept, drafted, redrawn), bonus.astype(mx.int32)[None]])
