"""The sampling rules that are not array plumbing, both sides of a cycle (what a draft forward proposes, what the
target accepts of it), written once over a small array namespace (`ArrayOps`) that each backend provides for its own
arrays (docs/sampling.md). tests/test_rules.py runs each rule on both backends side by side.

- Both sides: the order of the sampling filters, the inverse-CDF draw, the drafter's logit scaling, and the refusals
  both backends give.
- Accepted: the rejection rule with its residual draw (any proposal shape: q, q sharpened, one-hot), and
  multi-candidate rejection at tree nodes.
- Proposed: from the draft logits to [anchor, proposals] per row by its rule, the tree candidates, and the draft
  distribution q that rejection rows verify against. DFlash (`choose`): greedy rows take the argmax; match rows the
  argmax of the filtered logits, sharpened by the cycle's draft temperature t, plus the target's own Gumbel noise at
  each position (t = 1: the token the target draws whenever the draft's distribution equals its own; t = 0: the
  plain argmax); rejection rows draw from q_t, the filtered distribution sharpened to q^(1/t) on its Q_CANDIDATES
  most probable tokens, renormalised, with the draft stream's uniforms (t = 0: the one-hot q at the argmax). Sampled
  rows rank their tree candidates by the same score (multi rows: q's top-k, fixed before any target draw). DFlash2
  (`selector_walk`): the candidate selector's walk from the anchor, greedy, or for rejection rows drawn from
  q_t = softmax(S_t(a, .) / (T t)) with the same uniforms (t = 0: the greedy walk, q one-hot).

The backend supplies `filtered(params, logits)`: its own sampling filters (transformers' warpers, mlx-lm's samplers)
applied to one row's logits (P, V), as log-weights whose softmax is the distribution the row samples from.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .contract import Draft
from .sampling import SamplingParams

SLIDING_TREE_REFUSAL = ("{model_type} has sliding-window or linear-attention layers, whose caches cannot keep a "
                        "tree's accepted path")
SLIDING_BATCH_REFUSAL = ("--batch-size: batched decoding needs a full-attention target (this one has sliding-window "
                         "or linear-attention layers); use --batch-size 1")
Q_CANDIDATES = 64  # the most probable draft tokens q_t keeps (rejection rows)


class ArrayOps(Protocol):
    """What the rules need from an array library; arrays also support + - * / comparisons and [..., None]."""

    def sum(self, x, axis: int, keepdims: bool = False): ...
    def cumsum(self, x, axis: int): ...
    def where(self, condition, x, y): ...
    def maximum(self, x, y): ...
    def minimum(self, x, y): ...
    def tanh(self, x): ...
    def gather(self, x, ids, axis: int): ...                 # take_along_axis
    def scatter(self, like, ids, values, axis: int): ...    # zeros shaped like `like`, `values` put at `ids`
    def concatenate(self, parts: list, axis: int): ...
    def token_ids(self, x): ...                              # as the integer type token ids have
    def argmax(self, x, axis: int): ...                      # as token ids
    def softmax(self, x, axis: int): ...                     # in float32
    def top_k(self, x, k: int): ...                          # (values, ids) of the k largest, largest first
    def top_probs(self, logits, k: int): ...                 # top_k(softmax(logits)), in float32
    def stack(self, parts: list, axis: int = 0): ...
    def broadcast_to(self, x, shape: tuple): ...
    def zeros_like(self, x): ...
    def from_host(self, values: list[float], like): ...     # float32, on like's device


def filters(params: SamplingParams) -> list[tuple[str, float]]:
    """The sampling filters in the order transformers' generate() applies them: the temperature first, then top-k,
    top-p and min-p, each on the distribution the one before left (none when greedy)."""
    if params.greedy:
        return []
    steps = [("temperature", params.temperature)] if params.temperature != 1.0 else []
    if params.top_k:
        steps.append(("top_k", params.top_k))
    if params.top_p < 1.0:
        steps.append(("top_p", params.top_p))
    if params.min_p > 0:
        steps.append(("min_p", params.min_p))
    return steps


def inverse_cdf(ops: ArrayOps, probs, u):
    """One draw per row of probs (..., V) (not necessarily normalised) from its uniform u (...,)."""
    cdf = ops.cumsum(probs, axis=-1)
    index = ops.sum(cdf < (u * cdf[..., -1])[..., None], axis=-1)
    return ops.minimum(ops.token_ids(index), probs.shape[-1] - 1)


def rejection_tokens(ops: ArrayOps, p, drafted, q_ids, q_probs, accept_u, residual_u, bonus):
    """p (B, V): the target's probabilities at the B verified positions; drafted (B-1,): proposals sampled from the
    sparse q (B-1, k over q_ids). Position i keeps drafted[i] when accept_u[i] * q <= p (probability min(1, p/q)),
    else draws from max(0, p - q) normalised, with residual_u[i]; `bonus` is the target's own draw at position B-1.
    Every position at once: only the first rejection counts."""
    drafted = ops.token_ids(drafted)
    q = ops.scatter(p[:-1], ops.token_ids(q_ids), q_probs, axis=1)
    px = ops.gather(p[:-1], drafted[:, None], axis=1)[:, 0]
    qx = ops.gather(q, drafted[:, None], axis=1)[:, 0]
    accept = accept_u * qx <= px
    residual = ops.maximum(p[:-1] - q, 0.0)
    residual = ops.where(ops.sum(residual, axis=-1, keepdims=True) > 0, residual, p[:-1])  # p == q: never rejected
    redrawn = inverse_cdf(ops, residual, residual_u)
    return ops.concatenate([ops.where(accept, drafted, redrawn), ops.token_ids(bonus)[None]], axis=0)


def multi_candidate_tokens(ops: ArrayOps, p, children, counted, child_u, residual_u):
    """Recursive rejection sampling at N tree nodes (SpecInfer, arXiv 2305.09781) with one-hot proposals: p (N, V)
    the target's probabilities at each node; children (N, m) its candidate tokens in the order they are tried, the
    first counted[n] (a 0/1 mask, (N, m)) real and distinct, the rest repeating the first. Child c_j is kept with
    probability p'(c_j), p' = p with c_1 .. c_j-1 removed and renormalised (the residual max(p' - q', 0) of a
    one-hot q'), i.e. when child_u[:, j] * (1 - p(c_1) - .. - p(c_j-1)) <= p(c_j); no child kept: a draw from p with
    every child removed, with residual_u (N,). Returns the token each node decides (N,): a kept child, or a
    token that is none of them (so a walk that descends while a child matches accepts exactly the kept one)."""
    children = ops.token_ids(children)
    pc = ops.gather(p, children, axis=1) * counted
    removed_before = ops.cumsum(pc, axis=1) - pc
    kept = (child_u * (1.0 - removed_before) <= pc) & (counted > 0)
    first = kept & (ops.cumsum(ops.token_ids(kept), axis=1) == 1)
    token = ops.sum(ops.token_ids(first) * children, axis=1)
    removed = ops.scatter(p, children, ops.broadcast_to(counted[:, :1], children.shape), axis=1)
    residual = p * (1.0 - removed)
    residual = ops.where(ops.sum(residual, axis=-1, keepdims=True) > 0, residual, p)  # children cover p: never used
    return ops.where(ops.sum(ops.token_ids(first), axis=1) > 0, token, inverse_cdf(ops, residual, residual_u))


def scale_logits(ops: ArrayOps, logits, multiplier: float, softcap: float | None):
    """A drafter's output multiplier, then its tanh soft cap (DraftSpec.logit_scaling)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = ops.tanh(logits / softcap) * softcap
    return logits


# ---- what a draft forward proposes -----------------------------------------------------------------------------------
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
