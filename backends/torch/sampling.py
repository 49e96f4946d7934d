"""Drawing the target's token at each verified position, exactly as transformers' generate() would.

The logits are processed in vLLM's and mlx-lm's order: the logit bias, the repetition penalty (transformers' own
processor, over the prompt and the output), the presence and frequency penalties (over the output), then
transformers' warpers (temperature, top-k, top-p, min-p: generate()'s order). Row i of a verified block is processed
with the history it would have in target-only decoding: the committed tokens plus block[0..i].
"""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from dflash.core import rules
from dflash.core.sampling import SamplingParams

from .ops import TorchOps


@lru_cache(maxsize=256)
def sampler(params: SamplingParams) -> TorchSampler:
    """The sampler of these settings, built once: each step brings every row's settings (Target.sample)."""
    return TorchSampler(params)


class TorchSampler:
    """The processors of one row's settings. Its draws take their noise from the engine (dflash.core.sampling: noise
    tied to positions): the target's token is argmax(scores + Gumbel noise), an exact sample of softmax(scores)."""

    def __init__(self, params: SamplingParams):
        self.params = p = params
        self.repetition = RepetitionPenaltyLogitsProcessor(p.repetition_penalty) if p.repetition_penalty != 1.0 \
            else None
        self.warpers = LogitsProcessorList(warpers(p))
        self.processors = p.processors or bool(self.warpers)

    def scores(self, logits: torch.Tensor, history: list[int], block: torch.Tensor | None,
               paths: list[list[int]] | None = None, start: int = 0) -> torch.Tensor:
        """The processed logits (T, V) the token is drawn from (filtered tokens at -inf), for the T positions that
        follow history + block[:i+1] (a tree: history + paths[i]); the output starts at history[start]."""
        if not self.processors:
            return logits
        p, scores = self.params, logits.float()
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)
            scores = scores.index_add(-1, torch.tensor(ids, device=scores.device),
                                      torch.tensor(values, device=scores.device).expand(scores.shape[0], -1))
        if self.repetition is not None:
            hist = _histories(history, block, logits.device) if paths is None else \
                _tree_histories(history, paths, logits.device)
            scores = self.repetition(hist, scores)
        if p.output_penalties:
            counts = _counts(history[start:], block, paths, scores)
            scores = scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        return self.warpers(None, scores)  # type: ignore[arg-type]  # (warpers never read input_ids)

    def draw(self, scores: torch.Tensor, gumbel: torch.Tensor | None) -> torch.Tensor:
        if gumbel is None:
            return scores.argmax(dim=-1)
        # Gumbel-max needs no normalisation, so scores that overflowed (inf) or broke (nan, treated as -inf) cannot
        # make the draw raise for the whole batch (SamplingParams.validate keeps the settings that cause them out)
        return (scores.float().nan_to_num(nan=float("-inf")) + gumbel).argmax(dim=-1)


_WARPERS = {"temperature": TemperatureLogitsWarper, "top_k": TopKLogitsWarper, "top_p": TopPLogitsWarper,
            "min_p": MinPLogitsWarper}


def warpers(p: SamplingParams) -> list:
    """transformers' warpers, in the order of dflash.core.rules.filters (generate()'s); none when greedy."""
    return [_WARPERS[name](value) for name, value in rules.filters(p)]


def gumbel(keys: list[int], vocab: int, device) -> torch.Tensor:
    """(len(keys), vocab) standard Gumbel noise, row j drawn from a generator seeded with keys[j] alone."""
    rows = []
    for key in keys:
        g = torch.Generator(device=device).manual_seed(key)
        rows.append(torch.rand(vocab, generator=g, device=device))
    u = torch.stack(rows).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return rules.inverse_cdf(TorchOps, probs, u)


def rejection_tokens(p, drafted, q_ids, q_probs, accept_u, residual_u, bonus) -> torch.Tensor:
    """dflash.core.rules.rejection_tokens on torch tensors."""
    return rules.rejection_tokens(TorchOps, p, drafted, q_ids, q_probs, accept_u, residual_u, bonus)


def multi_candidate_tokens(p: torch.Tensor, draw) -> torch.Tensor:
    """dflash.core.rules.multi_candidate_tokens at a tree's nodes, with a multi row's children and noise
    (dflash.core.sampling.RowDraw)."""
    def tensor(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=p.device)
    return rules.multi_candidate_tokens(TorchOps, p, tensor(draw.children, torch.long), tensor(draw.counted),
                                        tensor(draw.child_u), tensor(draw.residual_u))


def log_probs(scores: torch.Tensor, tokens: torch.Tensor, top: int):
    """(chosen, top ids, top log-probs) of processed scores (..., V) and the tokens drawn from them."""
    lp = torch.log_softmax(scores.float(), dim=-1)
    chosen = lp.gather(-1, tokens[..., None]).squeeze(-1)
    values, ids = lp.topk(top, dim=-1) if top else (lp[..., :0], tokens[..., None][..., :0])
    return chosen, ids, values


def _histories(history: list[int], block: torch.Tensor | None, device) -> torch.Tensor:
    """(T, len(history) + T): row i = history + block[:i+1], padded with block[0] (already present in the row, so
    the set of penalised tokens is unchanged)."""
    hist = torch.tensor(history, dtype=torch.long, device=device)
    if block is None:
        return hist[None]
    t = block.shape[-1]
    b = block.reshape(-1)
    rows = b[None, :].expand(t, t).clone()
    upper = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1)
    rows[upper] = b[0]
    return torch.cat([hist[None].expand(t, -1), rows], dim=1)


def _counts(output: list[int], block: torch.Tensor | None, paths: list[list[int]] | None,
            scores: torch.Tensor) -> torch.Tensor:
    """(T, V) like scores: how often each token occurs in the history of position i's token, from the output's start
    (output + block[:i+1], or output + paths[i])."""
    (t, vocab), device = scores.shape, scores.device
    counts = torch.zeros(vocab + 1, device=device).index_add_(0, torch.tensor(output, dtype=torch.long, device=device),
                                                               torch.ones(len(output), device=device))
    counts = counts.expand(t, -1).clone()
    if paths is not None:  # (padded with id `vocab`: a column dropped below)
        width = max(len(q) for q in paths)
        extra = torch.tensor([q + [vocab] * (width - len(q)) for q in paths], dtype=torch.long, device=device)
    elif block is not None:
        b = block.reshape(-1)[:t]
        extra = b[None, :].expand(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool, device=device).triu(1), vocab)
    else:
        return counts[:, :vocab]
    counts.scatter_add_(1, extra, torch.ones(extra.shape, device=device))
    return counts[:, :vocab]


def _tree_histories(history: list[int], paths: list[list[int]], device) -> torch.Tensor:
    """(T, len(history) + depth): row i = history + paths[i], padded with the root token (already in every row)."""
    width = max(len(p) for p in paths)
    return torch.tensor([history + p + [p[0]] * (width - len(p)) for p in paths], dtype=torch.long, device=device)
