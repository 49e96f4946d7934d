"""Drawing the target's token at each verified position, exactly as transformers' generate() would.

The processors are transformers' own (repetition penalty, then temperature, top-k, top-p, min-p: generate()'s
order). Row i of a verified block is processed with the history it would have in target-only decoding: the
committed tokens plus block[0..i].
"""

from __future__ import annotations

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from dflash.core import rules
from dflash.core.sampling import SamplingParams

from .ops import TorchOps


class TorchSampler:
    """One row's processors. Its draws take their noise from the engine (dflash.core.sampling: noise tied to positions):
    the target's token is argmax(scores + Gumbel noise), an exact sample of softmax(scores)."""

    def __init__(self, params: SamplingParams, device=None):
        self.params = p = params
        procs = [RepetitionPenaltyLogitsProcessor(p.repetition_penalty)] if p.repetition_penalty != 1.0 else []
        self.warpers = LogitsProcessorList(warpers(p))
        self.processors = LogitsProcessorList(procs + list(self.warpers))

    def scores(self, logits: torch.Tensor, history: list[int], block: torch.Tensor | None,
               paths: list[list[int]] | None = None) -> torch.Tensor:
        """The processed logits (T, V) the token is drawn from (filtered tokens at -inf), for the T positions that
        follow history + block[:i+1] (a tree: history + paths[i])."""
        if not self.processors:
            return logits
        scores = logits.float()
        if self.params.repetition_penalty != 1.0:
            hist = _histories(history, block, logits.device) if paths is None else \
                _tree_histories(history, paths, logits.device)
            return self.processors(hist, scores)
        return self.processors(None, scores)

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


def _tree_histories(history: list[int], paths: list[list[int]], device) -> torch.Tensor:
    """(T, len(history) + depth): row i = history + paths[i], padded with the root token (already in every row)."""
    width = max(len(p) for p in paths)
    return torch.tensor([history + p + [p[0]] * (width - len(p)) for p in paths], dtype=torch.long, device=device)
