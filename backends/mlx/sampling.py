"""Drawing the target's token at each verified position with mlx-lm's own samplers and logits processors.

Row i of a verified block is processed with the history it would have in target-only decoding: the committed tokens
plus block[0..i]. The processors are mlx-lm's, in its order (the logit bias, the repetition, presence and frequency
penalties), each over the whole history it counts (mlx-lm defaults to the last 20 tokens; the torch backend, like
transformers and vLLM, uses all of them): the repetition penalty the prompt and the output, the presence and frequency
penalties the output only (OpenAI's and vLLM's reading). The filters are mlx-lm's, in transformers' order (the
temperature first, dflash.core.rules.filters), so both backends draw from the same distribution.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from dflash.core import rules
from dflash.core.sampling import SamplingParams

from .ops import MLXOps

_WHOLE_HISTORY = 2**31 - 1  # slice bounds must fit int32


@lru_cache(maxsize=256)
def sampler(params: SamplingParams) -> MLXSampler:
    """The sampler of these settings, built once: each step brings every row's settings (Target.sample)."""
    return MLXSampler(params)


class MLXSampler:
    """The processors and filters of one row's settings. Its draws take their noise from the engine
    (dflash.core.sampling: noise tied to positions): the target's token is argmax(filtered log-weights + Gumbel
    noise), an exact sample of them."""

    def __init__(self, params: SamplingParams):
        p = self.params = params
        # (history processors see the prompt and the output; output processors the output alone)
        self.history = make_logits_processors(
            logit_bias=dict(p.logit_bias) or None, repetition_context_size=_WHOLE_HISTORY,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None)
        self.output = make_logits_processors(
            presence_penalty=p.presence_penalty, presence_context_size=_WHOLE_HISTORY,
            frequency_penalty=p.frequency_penalty, frequency_context_size=_WHOLE_HISTORY)
        self.processors = self.history + self.output

    def processed(self, logits: mx.array, history: list[int], block: mx.array | None,
                  paths: list[list[int]] | None = None, start: int = 0) -> mx.array:
        """The logits after the logits processors; the output starts at history[start]."""
        if not self.processors:
            return logits
        rows = []
        for i in range(logits.shape[0]):
            if paths is not None:
                extra = mx.array(paths[i], dtype=mx.int32)
            else:
                extra = mx.array([], dtype=mx.int32) if block is None else block[: i + 1].astype(mx.int32)
            row = logits[i:i + 1].astype(mx.float32)
            if self.history:
                tokens = mx.concatenate([mx.array(history, dtype=mx.int32), extra])
                for proc in self.history:
                    row = proc(tokens, row)
            if self.output:
                tokens = mx.concatenate([mx.array(history[start:], dtype=mx.int32), extra])
                for proc in self.output:
                    row = proc(tokens, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def draw(self, logits: mx.array, gumbel: mx.array | None) -> mx.array:
        if gumbel is None:
            return mx.argmax(logits, axis=-1)
        return mx.argmax(self.filtered(logits) + gumbel, axis=-1)

    def filtered(self, logits: mx.array) -> mx.array:
        """Processed logits (T, V) -> the log-probs the draw is taken from: mlx-lm's filters in the order of
        dflash.core.rules.filters (transformers': the temperature first), each on the renormalised result of the one
        before; greedy: the log-probs."""
        logprobs = _normalised(logits.astype(mx.float32))
        for name, value in rules.filters(self.params):
            if name == "temperature":
                logprobs = logprobs / value
            elif name == "top_k" and value < logprobs.shape[-1]:
                logprobs = apply_top_k(logprobs, int(value))
            elif name == "top_p":
                logprobs = apply_top_p(logprobs, value)
            elif name == "min_p":
                logprobs = apply_min_p(logprobs, value)
            logprobs = _normalised(logprobs)
        return logprobs

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


def _normalised(logprobs: mx.array) -> mx.array:
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def gumbel(keys: list[int], vocab: int) -> mx.array:
    """(len(keys), vocab) standard Gumbel noise, row j drawn with the key keys[j] alone."""
    return mx.stack([mx.random.gumbel(shape=(vocab,), key=mx.random.key(k)) for k in keys])


def inverse_cdf(probs: mx.array, u: mx.array) -> mx.array:
    return rules.inverse_cdf(MLXOps, probs, u)


def rejection_tokens(p, drafted, q_ids, q_probs, accept_u, residual_u, bonus) -> mx.array:
    """dflash.core.rules.rejection_tokens on mx.arrays."""
    return rules.rejection_tokens(MLXOps, p, drafted, q_ids, q_probs, accept_u, residual_u, bonus)


def multi_candidate_tokens(p: mx.array, draw) -> mx.array:
    """dflash.core.rules.multi_candidate_tokens at a tree's nodes, with a multi row's children and noise
    (dflash.core.sampling.RowDraw)."""
    return rules.multi_candidate_tokens(MLXOps, p, mx.array(draw.children, dtype=mx.int32),
                                        *(mx.array(x, dtype=mx.float32) for x in (draw.counted, draw.child_u,
                                                                                 draw.residual_u)))
