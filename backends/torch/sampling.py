"""Drawing the target's token at each verified position, exactly as transformers' generate() would.

The processors are transformers' own (repetition penalty, then temperature, top-k, top-p, min-p: generate()'s
order). Row i of a verified block is processed with the history it would have in target-only decoding: the
committed tokens plus block[0..i].
"""

from __future__ import annotations

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from dflash.sampling import SamplingParams


class TorchSampler:
    def __init__(self, params: SamplingParams, device):
        self.params = params
        p = params
        procs = []
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if not p.greedy:
            if p.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(p.temperature))
            if p.top_k:
                procs.append(TopKLogitsWarper(p.top_k))
            if p.top_p < 1.0:
                procs.append(TopPLogitsWarper(p.top_p))
            if p.min_p > 0:
                procs.append(MinPLogitsWarper(p.min_p))
        self.processors = LogitsProcessorList(procs)
        self.generator = None
        if not p.greedy:
            self.generator = torch.Generator(device=device)
            if p.seed is not None:
                self.generator.manual_seed(p.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: list[int], block: torch.Tensor | None,
                 paths: list[list[int]] | None = None) -> torch.Tensor:
        """logits (T, V) for the T positions that follow history + block[:i+1] (a tree: history + paths[i]);
        returns T token ids."""
        return self.draw(self.scores(logits, history, block, paths))

    def scores(self, logits: torch.Tensor, history: list[int], block: torch.Tensor | None,
               paths: list[list[int]] | None = None) -> torch.Tensor:
        """The processed logits (T, V) the token is drawn from (filtered tokens at -inf)."""
        if not self.processors:
            return logits
        scores = logits.float()
        if self.params.repetition_penalty != 1.0:
            hist = _histories(history, block, logits.device) if paths is None else \
                _tree_histories(history, paths, logits.device)
            return self.processors(hist, scores)
        return self.processors(None, scores)

    def draw(self, scores: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores.float(), dim=-1)
        # guard: a row whose scores overflowed (inf / nan) would make multinomial raise for the whole batch;
        # it takes its argmax instead (SamplingParams.validate keeps the settings that cause this out)
        broken = ~torch.isfinite(probs).all(dim=-1)
        if broken.any():
            probs = torch.where(broken[:, None], torch.nn.functional.one_hot(
                scores.float().nan_to_num(nan=float("-inf")).argmax(dim=-1), probs.shape[-1]).to(probs.dtype), probs)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def rejection(self, logits: torch.Tensor, history: list[int], block: torch.Tensor, q_ids: torch.Tensor,
                  q_probs: torch.Tensor) -> torch.Tensor:
        """Rejection sampling of one row (sampling mode): logits (B, V), block (B,) = [anchor, drafts], the draft
        distributions q_probs over q_ids (B-1, k). Returns B ids (dflash.sampling: the rule)."""
        p = torch.softmax(self.scores(logits, history, block).float(), dim=-1)
        return rejection_tokens(p, block[1:], q_ids, q_probs.float(), self.generator)


def rejection_tokens(p: torch.Tensor, drafted: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                     generator) -> torch.Tensor:
    """p (B, V) target probabilities at the B verified positions, drafted (B-1,) sampled from the sparse q (B-1, k
    over q_ids). Position i keeps drafted[i] with probability min(1, p/q), else draws from max(0, p - q)
    normalised; position B-1 draws the bonus from p. Every position at once: only the first rejection counts."""
    q = torch.zeros_like(p[:-1]).scatter_(1, q_ids, q_probs)
    px, qx = p[:-1].gather(1, drafted[:, None])[:, 0], q.gather(1, drafted[:, None])[:, 0]
    u = torch.rand(px.shape, generator=generator, device=p.device, dtype=p.dtype)
    accept = u * qx <= px
    residual = (p[:-1] - q).clamp_(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:-1])  # p == q: never rejected anyway
    redrawn = torch.multinomial(residual, 1, generator=generator)[:, 0]
    bonus = torch.multinomial(p[-1:], 1, generator=generator)[:, 0]
    return torch.cat([torch.where(accept, drafted, redrawn), bonus])


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
