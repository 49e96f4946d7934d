"""Acceptance statistics: tau (mean acceptance length), histogram, per-position acceptance."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def mean_acceptance_length(lengths: list[int]) -> float:
    """tau: tokens committed per verification cycle (accepted draft tokens + the target's bonus token)."""
    return sum(lengths) / len(lengths) if lengths else 0.0


def acceptance_histogram(lengths: list[int], block_size: int) -> list[int]:
    """counts[k-1] = cycles that committed k tokens, k = 1 .. block_size."""
    c = Counter(lengths)
    return [c.get(k, 0) for k in range(1, block_size + 1)]


def per_position_acceptance(lengths: list[int], block_size: int) -> list[float]:
    """rate[k-1] = fraction of cycles whose k-th drafted token was accepted, k = 1 .. block_size-1."""
    if not lengths:
        return [0.0] * (block_size - 1)
    return [sum(1 for n in lengths if n - 1 >= k) / len(lengths) for k in range(1, block_size)]


def summary_line(tau: float, tokens_per_second: float, n_tokens: int, prefill_seconds: float) -> str:
    return (f"tau {tau:.2f} | {tokens_per_second:.1f} tok/s | {n_tokens} tokens | "
            f"prefill {prefill_seconds * 1000:.0f} ms")


@dataclass(frozen=True)
class CycleCounts:
    """What the verify cycles did. A cycle of --verify auto may run no draft forward (the drafter paused, or
    --no-draft), or run one and verify none of it (no proposal was predicted to pay for its verify cost): both are
    plain target steps."""

    cycles: int
    drafted: int  # cycles that ran a draft forward
    drafted_verifying_none: int  # ... and verified none of its proposals
    verified_when_drafted: list[int]  # draft tokens verified, per cycle that ran a draft forward

    @property
    def without_draft(self) -> int:
        return self.cycles - self.drafted


def cycle_counts(verified: list[int], draft_forwards: list[bool]) -> CycleCounts:
    drafted = [v for v, forward in zip(verified, draft_forwards) if forward]
    return CycleCounts(len(verified), len(drafted), drafted.count(0), drafted)
