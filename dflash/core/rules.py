"""The sampling rules that are not array plumbing, written once over a small array namespace (`ArrayOps`) that
each backend provides for its own arrays: the order of the sampling filters, the rejection rule with its residual
draw (any proposal shape: q, q sharpened, one-hot), multi-candidate rejection at tree nodes (docs/sampling.md),
the inverse-CDF draw, the drafter's logit scaling, and the refusals both backends give
(what a draft proposes: dflash/core/proposals.py). tests/test_policy.py runs each rule on both backends side by
side."""

from __future__ import annotations

from typing import Protocol

from .sampling import SamplingParams

SLIDING_TREE_REFUSAL = ("{model_type} has sliding-window or linear-attention layers, whose caches cannot keep a "
                        "tree's accepted path")
SLIDING_BATCH_REFUSAL = ("--batch-size: batched decoding needs a full-attention target (this one has sliding-window "
                         "or linear-attention layers); use --batch-size 1")


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
