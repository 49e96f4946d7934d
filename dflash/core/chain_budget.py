"""--verify auto for rows that verify by rejection (chains only, dflash/core/sampling.py): how many of the drafter's B-1
sampled proposals a cycle verifies, and whether it drafts at all. Greedy rows' trees are dflash/core/budget.py's.
"""

from __future__ import annotations

from typing import Sequence

from .budget import Pause
from .cycle_times import CycleTimes

PLAIN_EVERY = 32  # drafted cycles in a row before a plain step is timed again


class ChainBudget:
    """auto for rows that verify by rejection (chains only): how many of the B-1 sampled proposals a cycle verifies,
    and whether it drafts at all. Expected tokens of a chain of L proposals are 1 + sum_j prod_{i<=j} a_i with a_i
    the measured rate at which position i accepts when reached (an exponential average over recent cycles, under the
    rule in use; a position never reached yet is taken to accept as the one before it, so that chains grow where the
    first positions accept); seconds are those of a cycle drafting and verifying L + 1 positions, learnt from the
    cycles' own wall times (dflash/core/cycle_times.py; the draft fills only the positions verified). L = 0 is a plain
    target step without the draft forward; while it wins, drafting pauses for 1, 2, 4 .. 64 cycles between probes, as
    the tree planner's pauses do."""

    def __init__(self, block_size: int, times: CycleTimes, prior: float = 0.5, smoothing: float = 0.1):
        self.times, self.smoothing = times, smoothing
        self.rates = [prior] * (block_size - 1)
        self.reached = 0  # positions some cycle has verified (the rates past them are the prior's)
        self.pause, self.probing = Pause(), False
        self.probe = False  # this cycle drafts after a pause (or at a request's start)
        self.since_plain = 0  # drafted cycles since the last plain one

    def expected(self, length: int) -> float:
        tokens, reach, last = 1.0, 1.0, self.rates[0]
        for i, a in enumerate(self.rates[:length]):
            last = a if i < max(self.reached, 1) else last
            reach *= last
            tokens += reach
        return tokens

    def seconds(self, length: int, rows: int = 1) -> float:
        """A cycle's seconds verifying `length` proposals per row (0: no draft forward)."""
        return self.times.cycle_seconds(length + 1, rows, length > 0, length + 1)

    def length(self, can_pause: bool = True, rows: int = 1) -> int:
        """Proposals every one of `rows` rows verifies this cycle (0: no draft forward; only when `can_pause`). The
        cycle after a pause drafts (a probe), so the acceptance estimates stay current."""
        if can_pause and (self.pause.waits() or self.since_plain >= PLAIN_EVERY):
            return 0  # a pause; or a plain step now and then, to keep its time known
        best = max(range(1, len(self.rates) + 1), key=lambda n: self.expected(n) / self.seconds(n, rows))
        if not can_pause:
            return best
        plain_wins = self.expected(0) / self.seconds(0, rows) > self.expected(best) / self.seconds(best, rows)
        if plain_wins and not self.probing:
            self.pause.observe(False)
            self.pause.skip -= 1  # (this cycle is the pause's first)
            self.probing = True
            return 0
        self.probe, self.probing = self.probing, False
        if not plain_wins:
            self.pause.observe(True)
        return best

    def reset(self) -> None:
        """A new request: its first cycle drafts, a probe of its own text (the pause's length is kept, so a probe
        that loses again pauses as long as before)."""
        self.pause.skip, self.probing = 0, True

    @property
    def pauses_next(self) -> bool:
        """Whether the next cycle is a plain step too (a pause goes on)."""
        return self.pause.skip > 0

    def observe(self, length: int, accepted: Sequence[int], seconds: float) -> None:
        """One cycle: `length` proposals verified per row, rows accepted `accepted[r]` of them, in `seconds`."""
        s = self.smoothing
        self.reached = max(self.reached, length)
        for k in accepted:
            for i in range(min(k + 1, length)):  # position i was reached; accepted unless i == k
                self.rates[i] += s * ((1.0 if i < k else 0.0) - self.rates[i])
        drafted = length > 0
        self.since_plain = self.since_plain + 1 if drafted else 0
        rows = max(len(accepted), 1)
        if drafted and self.probe:
            # a probe judged by what it committed: one that beat the plain step halves the next pause (a quarter
            # here, doubled when it starts), so rates a bad stretch pulled down are measured again within a few
            # dozen cycles (docs/sampling.md has the measurements)
            self.probe = False
            if sum(accepted) and (1 + sum(accepted) / rows) / seconds > 1 / self.seconds(0, rows):
                self.pause.backoff //= 4
        self.times.observe(length + 1, rows, drafted, seconds, length + 1)
