"""The values the engine and the backends hand each other in a cycle (draft -> verify -> commit), and what the
engine returns to the loop for each row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pending:
    """Target features (rows, m, K*H) the drafter has not read yet; row i's first counts[i] are real."""

    features: object
    counts: list[int]


@dataclass
class Draft:
    """One draft forward's output, on the device: `ids` (rows, B) = [anchor, proposals], and per block position
    the drafter's top-k token ids and probabilities (rows, B-1, k), when asked for (tree verification)."""

    ids: object
    top_ids: object = None
    top_probs: object = None
    # when the drafter sampled its proposals (rejection verification): per proposal the candidate ids and the draft
    # distribution q over them (rows, B-1, k)
    q_ids: object = None
    q_probs: object = None


@dataclass
class Step:
    """One row's cycle: the tokens it committed (accepted draft tokens, then the target's own token) and what the
    target verified for it."""

    tokens: list[int]
    drafted: list[int]  # the proposals the target checked (chain), or the accepted path's (tree)
    verified: int  # draft tokens the target verified for this row
    draft_forward: bool = True  # False: a cycle of --verify auto that verified without drafting
    # with Engine.logprobs set: per committed token, the target's log-probability of it under
    # the row's sampling settings and the top (id, log-probability) pairs, from the verify forward's own logits
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1
