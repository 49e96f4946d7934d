"""What a cycle costs on this machine, learnt from the engine's own cycles (nothing measured at load, nothing cached):

    seconds = c_cycle + c_row * rows + c_token * verify tokens + c_draft * drafted + c_position * draft positions

fitted to the recent cycles in relative misses (old ones and outliers weighing less), pulled to PRIOR where the cycles
cannot tell its terms apart, times the machine's speed now (`level`: a busy neighbour is followed within a few
cycles); a shape is priced at a lower confidence bound, so an untried one gets tried (as in LinUCB).
docs/verification.md ("Seconds") says why each part is there."""

from __future__ import annotations

import numpy as np

# the prior, in plain steps of one row: per cycle, row, verify token, draft forward, draft position (a 2-core CPU's
# proportions: the reference pair's 16-token chain cycle measured 3.2 plain steps, this says 3.07)
PRIOR = np.array([0.7, 0.2, 0.1, 0.25, 0.02])
PRIOR_SD = 1.0  # the prior's standard deviation per term, relative to the term
WINDOW = 256  # the cycles the terms are fitted to ...
HALF_LIFE = 64  # ... a cycle this many cycles old weighing half
LEVEL_CYCLES = 16  # the cycles the machine's speed now is the median over
REFRESH = 8  # cycles between fits (after each of the first LEVEL_CYCLES)
NOISE = 0.05  # the least relative scatter of a cycle around the fit (a quiet machine does not make it certain)
OUTLIER = 3.0  # a cycle further off the fit than this many scatters counts less, in proportion (Huber)
EXPLORE = 0.5  # standard deviations below the estimate a shape is priced at ...
CHEAPEST = 0.5  # ... and at least this share of it (more optimism probes a drafter never right every few cycles)
GUESS = 0.005  # seconds of a plain step before the first cycle (so the first cycle's rates are in seconds too)
FLOOR = 0.01  # no term falls below this share of the prior (a term at 0 would price a shape free)


def features(tokens: int, rows: int, drafted: bool, block: int | None, draft_rows: int | None,
             block_size: int) -> np.ndarray:
    """A cycle's shape as the model's terms: rows verifying `tokens` each, after a draft forward (if `drafted`) of
    `block` positions (default: the whole block) for `draft_rows` rows (default: all)."""
    positions = (draft_rows if draft_rows is not None else rows) * (block or block_size) if drafted else 0
    return np.array([1.0, rows, rows * tokens, float(drafted), positions])


class CycleTimes:
    """Seconds of a cycle of any shape (cycle_seconds), learnt from the cycles that ran (observe)."""

    def __init__(self, block_size: int):
        self.block_size = block_size  # a draft forward's positions when a call names none
        self.terms = PRIOR * GUESS  # the terms' estimates (seconds) ...
        self.spread: np.ndarray = np.diag((PRIOR_SD * self.terms) ** 2)  # ... and their covariance
        self.level = 1.0  # the machine's speed now over the fit's
        self.shapes = np.zeros((WINDOW, len(PRIOR)))  # the last WINDOW cycles' features ...
        self.seconds = np.zeros(WINDOW)  # ... and seconds
        self.observed = 0
        self._memo: dict[tuple, float] = {}  # the shapes priced since the last fit, at level 1

    def expected_seconds(self, tokens: int, rows: int = 1, drafted: bool = True, block: int | None = None,
                         draft_rows: int | None = None) -> float:
        """A cycle's estimated seconds."""
        return self.level * float(self.terms @ features(tokens, rows, drafted, block, draft_rows, self.block_size))

    def cycle_seconds(self, tokens: int, rows: int = 1, drafted: bool = True, block: int | None = None,
                      draft_rows: int | None = None) -> float:
        """A cycle's seconds as plans price it: the estimate less EXPLORE deviations, at least CHEAPEST of it."""
        key = (tokens, rows, drafted, block, draft_rows)
        seconds = self._memo.get(key)
        if seconds is None:
            x = features(tokens, rows, drafted, block, draft_rows, self.block_size)
            estimate = float(self.terms @ x)
            seconds = self._memo[key] = max(estimate - EXPLORE * self.deviation(x), CHEAPEST * estimate)
        return self.level * seconds

    def deviation(self, x: np.ndarray) -> float:
        """The standard deviation of the fit's seconds of shape x."""
        return float(np.sqrt(max(float(x @ self.spread @ x), 0.0)))

    def observe(self, tokens: int, rows: int, drafted: bool, seconds: float, block: int | None = None,
                draft_rows: int | None = None) -> None:
        """A cycle of this shape took `seconds` (a time that is not positive teaches nothing)."""
        if not seconds > 0:
            return
        slot = self.observed % WINDOW
        self.shapes[slot] = features(tokens, rows, drafted, block, draft_rows, self.block_size)
        self.seconds[slot] = seconds
        self.observed += 1
        if self.observed <= LEVEL_CYCLES or self.observed % REFRESH == 0:
            self._fit()
        recent = (slot - np.arange(min(self.observed, LEVEL_CYCLES))) % WINDOW
        self.level = float(np.median(self.seconds[recent] / (self.shapes[recent] @ self.terms)))

    def _fit(self) -> None:
        """The terms of the least relative misses over the window, newer cycles weighing more and the prior (at the
        cycles' level) one standard deviation per term; twice, the second time with the cycles far off the first fit
        counting less."""
        n = min(self.observed, WINDOW)
        shapes, seconds = self.shapes[:n], self.seconds[:n]
        age = (self.observed - 1 - np.arange(n)) % WINDOW
        prior = PRIOR * float(np.median(seconds / (shapes @ PRIOR)))  # (the prior at the cycles' level)
        if self.observed == 1:
            self.terms = prior
        information = np.diag(1 / (PRIOR_SD * prior) ** 2)
        for _ in range(2):
            estimates = shapes @ self.terms
            misses = np.abs(seconds - estimates) / estimates
            noise = max(NOISE, 1.4826 * float(np.median(misses)))  # (the median miss: a robust scatter)
            weights = 0.5 ** (age / HALF_LIFE) * np.minimum(1.0, OUTLIER * noise / np.maximum(misses, 1e-12)) \
                / (noise * estimates) ** 2
            self.spread = np.linalg.inv((shapes.T * weights) @ shapes + information)
            self.terms = np.maximum(self.spread @ ((shapes.T * weights) @ seconds + information @ prior),
                                    FLOOR * prior)
        self._memo.clear()
