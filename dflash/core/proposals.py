"""What a draft forward proposes, written once over the array namespace of dflash.core.rules (`ArrayOps`): from the
draft logits to [anchor, proposals] per row by its rule, the tree candidates, and the draft distribution q that
rejection rows verify against (docs/sampling.md).

- DFlash (`choose`): greedy rows take the argmax; match rows the argmax of the filtered logits, sharpened by the
  cycle's draft temperature t, plus the target's own Gumbel noise at each position (t = 1: the token the target
  draws whenever the draft's distribution equals its own; t = 0: the plain argmax); rejection rows draw from q_t,
  the filtered distribution sharpened to q^(1/t) on its Q_CANDIDATES most probable tokens, renormalised, with the
  draft stream's uniforms (t = 0: the one-hot q at the argmax). Sampled rows rank their tree candidates by the
  same score (multi rows: q's top-k, fixed before any target draw).
- DFlash2 (`selector_walk`): the candidate selector's walk from the anchor, greedy, or for rejection rows drawn from
  q_t = softmax(S_t(a, .) / (T t)) with the same uniforms (t = 0: the greedy walk, q one-hot).

The backend supplies `filtered(params, logits)`: its own sampling filters (transformers' warpers, mlx-lm's samplers)
applied to one row's logits (P, V), as log-weights whose softmax is the distribution the row samples from.
"""

from __future__ import annotations

from typing import Any, Callable

from .contract import Draft
from .rules import ArrayOps, inverse_cdf

Q_CANDIDATES = 64


def choose(ops: ArrayOps, anchor_ids, logits, draws, top_k: int, filtered: Callable) -> Draft:
    """anchor_ids (rows, 1), logits (rows, P, V) -> the Draft of every row by its RowDraw (None: all greedy)."""
    greedy = ops.argmax(logits, axis=-1)
    if not draws or all(d.rule == "greedy" for d in draws):
        return _with_top(ops, Draft(ops.concatenate([anchor_ids, ops.token_ids(greedy)], axis=1)), logits, top_k)
    positions = logits.shape[1]
    proposals: list = []
    tops: list[Any] = [None] * len(draws)
    qs: list[tuple[Any, Any] | None] = [None] * len(draws)  # per row: q's candidate ids and probabilities
    for i, draw in enumerate(draws):
        if draw.rule == "greedy":
            proposals.append(greedy[i])
            continue
        warped, t = filtered(draw.params, logits[i]), draw.draft_temperature
        if draw.rule == "match":  # t = 0: the plain argmax; else argmax(log q_t + the target's own noise)
            score = warped if t == 0 else (warped if t == 1.0 else warped / t) + draw.gumbel[:positions]
            proposals.append(ops.argmax(score, axis=-1))
            if top_k:
                tops[i] = ops.top_probs(score, top_k)
            continue
        probs, ids = ops.top_probs(warped / t if 0 < t < 1.0 else warped, min(Q_CANDIDATES, warped.shape[-1]))
        if t == 0:  # one-hot: the argmax, and q certain of it
            probs = one_hot(ops, ops.token_ids(ops.zeros_like(probs[:, 0])), probs)
            proposals.append(ids[:, 0])
        else:
            probs = probs / ops.sum(probs, axis=-1, keepdims=True)
            pick = inverse_cdf(ops, probs, ops.from_host(draw.draft_u[:positions], like=probs))
            proposals.append(ops.gather(ids, pick[:, None], axis=1)[:, 0])
        qs[i] = (ids, probs)
        if top_k:  # (multi rows: the tree's children are q's most probable tokens)
            tops[i] = ops.top_probs(warped, top_k)
    draft = Draft(ops.concatenate([anchor_ids, ops.token_ids(ops.stack(proposals))], axis=1))
    if any(q is not None for q in qs):
        ids, probs = next(q for q in qs if q is not None)
        draft.q_ids = ops.stack([q[0] if q else ops.zeros_like(ids) for q in qs])
        draft.q_probs = ops.stack([q[1] if q else ops.zeros_like(probs) for q in qs])
    if top_k and any(t is not None for t in tops):
        plain = ops.top_probs(logits, top_k)
        pairs = [t if t is not None else (plain[0][i], plain[1][i]) for i, t in enumerate(tops)]
        draft.top_probs, draft.top_ids = ops.stack([p for p, _ in pairs]), ops.stack([x for _, x in pairs])
    return _with_top(ops, draft, logits, top_k)


def selector_walk(ops: ArrayOps, anchor_ids, candidates, scores, draws, logits, top_k: int) -> Draft:
    """DFlash2: candidates (rows, P, k) and the selector's pair scores (rows, P, k, k) -> the Draft of every row."""
    greedy, _ = walk(ops, candidates, scores)
    sampled = [i for i, d in enumerate(draws or ()) if d.rejects]
    if not sampled:
        return _with_top(ops, Draft(ops.concatenate([anchor_ids, ops.token_ids(greedy)], axis=1)), logits, top_k)
    rows = [greedy[i] for i in range(greedy.shape[0])]
    q_probs = [None] * len(rows)
    for i in sampled:
        draw = draws[i]
        t = draw.params.temperature * draw.draft_temperature
        u = ops.from_host(draw.draft_u[:candidates.shape[1]], like=scores)[None]
        tokens, scored = walk(ops, candidates[i:i + 1], scores[i:i + 1], t, u)
        rows[i] = tokens[0]
        q_probs[i] = ops.softmax(scored[0] / t, axis=-1) if t else \
            one_hot(ops, ops.argmax(scored[0], axis=-1), scored[0])
    zeros = ops.zeros_like(q_probs[sampled[0]])  # (greedy rows: no q; their acceptance never reads it)
    draft = Draft(ops.concatenate([anchor_ids, ops.token_ids(ops.stack(rows))], axis=1))
    draft.q_ids, draft.q_probs = candidates, ops.stack([q if q is not None else zeros for q in q_probs])
    return _with_top(ops, draft, logits, top_k)


def walk(ops: ArrayOps, candidates, scores, temperature: float = 0.0, u=None):
    """The selector's walk from the anchor (on the device: nothing is read back): greedy takes argmax_j S_t(a, j);
    with a temperature, draws j from softmax(S_t(a, .) / T) with the uniforms u (rows, P). Returns the tokens
    (rows, P) and each step's scores row (rows, P, k)."""
    rows, positions, k = candidates.shape
    choice = ops.token_ids(ops.zeros_like(candidates[:, :1, 0]))  # step 0: every predecessor is the anchor
    picks, chosen = [], []
    for t in range(positions):
        row = ops.gather(scores[:, t], ops.broadcast_to(choice[:, :, None], (rows, 1, k)), axis=1)[:, 0]
        if temperature > 0:
            choice = inverse_cdf(ops, ops.softmax(row / temperature, axis=-1), u[:, t])[:, None]
        else:
            choice = ops.argmax(row, axis=-1)[:, None]
        picks.append(choice)
        chosen.append(row)
    index = ops.concatenate(picks, axis=1)
    return ops.gather(candidates, index[:, :, None], axis=-1)[..., 0], ops.stack(chosen, axis=1)


def one_hot(ops: ArrayOps, index, like):
    """(P, k) shaped like `like`: 1 at index[p] in row p, 0 elsewhere (a point-mass q over k candidates)."""
    ones = ops.zeros_like(like[:, :1]) + 1.0
    return ops.scatter(like, ops.token_ids(index)[:, None], ones, axis=1)


def _with_top(ops: ArrayOps, draft: Draft, logits, top_k: int) -> Draft:
    """Tree verification's per-position candidates, where the rule did not rank them: the draft's top-k by
    probability."""
    if top_k and draft.top_ids is None:
        draft.top_probs, draft.top_ids = ops.top_probs(logits, top_k)
    return draft
