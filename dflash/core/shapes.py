"""The shape of a sampled row's proposals, chosen per row from the acceptance its own earlier cycles saw: a draft
temperature t, the drafter's q (at the request's temperature and filters) sharpened to q_t ~ q^(1/t) (t = 0: argmax q).
Under rejection a position accepts with probability 1 - TV(p, q_t), at t = 0 p(argmax q): a drafter sharper than the
target at the request's temperature (trained on greedy answers, sampled at 0.8) accepts more at a small t. Under
coupled match (argmax(log q_t + the target's own Gumbel noise)) t changes what is drafted, never what is emitted.

Cycle k's choice reads only cycles before k and its own exploration uniform, never the cycle's draws: conditioned on
the past, a cycle verifies a proposal fixed before its noise is read, so every row stays an exact sample."""

from __future__ import annotations

from typing import Sequence

# the draft temperatures an unseeded DFlash row chooses from (q, sharpened, argmax; ties go to the first), and a
# matched one (coupled, argmax)
SHAPES = (1.0, 0.5, 0.0)
MATCH_SHAPES = (1.0, 0.0)
MIN_TESTED = 8  # draft positions each shape tests before the estimates choose (one lucky cycle decides nothing)
EXPLORE = 0.05  # the share of cycles after that which try a shape at random (keyed by position: dflash.core.sampling)
DECAY = 0.95  # per observation of a shape: its estimate follows the text as it changes


class ShapeChoice:
    """One row's running estimate, per shape, of the share of verified draft positions it accepted (a decaying
    count of accepted positions over positions tested: a chain of any length accepts more as that share grows)."""

    def __init__(self, temperatures: Sequence[float], explore: float = EXPLORE, decay: float = DECAY):
        self.temperatures = tuple(temperatures)
        self.explore, self.decay = explore, decay
        self.accepted = [0.0] * len(self.temperatures)
        self.tested = [0.0] * len(self.temperatures)

    def choose(self, u: float) -> float:
        """The next cycle's draft temperature; u: the cycle's exploration uniform in (0, 1)."""
        n = len(self.temperatures)
        if n == 1:
            return self.temperatures[0]
        least = min(range(n), key=lambda i: self.tested[i])
        if self.tested[least] < MIN_TESTED:
            return self.temperatures[least]  # every shape tests MIN_TESTED positions first, in turn
        if u < self.explore:
            return self.temperatures[min(int(u / self.explore * n), n - 1)]
        return self.temperatures[max(range(n), key=self.rate)]

    def rate(self, i: int) -> float:
        return self.accepted[i] / self.tested[i] if self.tested[i] else 0.0

    def observe(self, temperature: float, accepted: int, verified: int) -> None:
        """A drafted cycle with this shape verified `verified` proposals and accepted the first `accepted`: the
        positions tested are the accepted ones and the first rejected one."""
        if verified == 0 or temperature not in self.temperatures:
            return
        i = self.temperatures.index(temperature)
        self.accepted[i] = self.decay * self.accepted[i] + accepted
        self.tested[i] = self.decay * self.tested[i] + min(accepted + 1, verified)
