"""What a cycle costs on this machine, learnt from the engine's own cycles (no profile at load, nothing cached), for
shapes not run yet too: a linear model

    seconds = c_cycle + c_row * rows + c_token * verify tokens + c_draft * drafted + c_position * draft positions

tracked by a Kalman filter (each term a random walk, each cycle's wall time one noisy observation of their sum) from
PRIOR at the first cycle's level; a shape is priced at a lower confidence bound (an untried one gets tried, as in
LinUCB). docs/verification.md ("Seconds") says why each part is there."""

from __future__ import annotations

import numpy as np

# the prior, in plain steps of one row: per cycle, row, verify token, draft forward, draft position (a 2-core CPU's
# proportions: the reference pair's 16-token chain cycle measured 3.2 plain steps, this says 3.07)
PRIOR = np.array([0.7, 0.2, 0.1, 0.25, 0.02])
PRIOR_SD = 1.0  # the prior's standard deviation per term, relative to the term
DRIFT = 0.01  # how far a term may move per cycle, relative to it (its random walk's standard deviation)
NOISE = 0.1  # a cycle's wall time's least standard deviation around the model, relative to the prediction ...
NOISE_SMOOTHING = 0.02  # ... learnt from the cycles' squared misses at this weight (slower than the surprise below,
# so a machine time-slicing between processes reads as noisy, not as changed every cycle)
OUTLIER = 3.0  # a cycle further above (or below) the prediction than this counts less, in proportion
EXPLORE = 0.5  # standard deviations below the estimate a shape is priced at ...
CHEAPEST = 0.5  # ... and at least this share of it (more optimism probes a drafter never right every few cycles)
GUESS = 0.005  # seconds of a plain step before the first cycle (so the first cycle's rates are in seconds too)
LEVEL_MISS = 3.0  # ... a cycle among the first LEVEL_CYCLES this far off the model sets the level again
LEVEL_CYCLES = 8
FLOOR = 0.01  # no term falls below this share of the prior at the level (a term at 0 would price a shape free)
REFRESH = 8  # cycles between re-pricings of the shapes plans ask for (hundreds a plan; the terms move slowly)
SURPRISE = 4.0  # the recent cycles' squared errors over the model's expected ones past which it is made less sure
SURPRISE_SMOOTHING = 0.1  # weight of one cycle's (capped at 25) in that average


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
        self.learns = True
        self.level = GUESS  # seconds per plain step of the prior
        self.theta = PRIOR * GUESS  # the terms' estimates
        self.spread = np.diag((PRIOR_SD * self.theta) ** 2)  # their covariance
        self.surprise = 1.0  # the recent cycles' squared errors over the model's expected ones (averaged)
        self.noise = NOISE  # a cycle's relative standard deviation around the model (learnt)
        self.observed = 0
        self._memo: dict[tuple, float] = {}  # shapes priced since the last re-pricing

    @classmethod
    def fixed(cls, plain: float, token: float, draft: float, block_size: int = 16) -> CycleTimes:
        """A device that is not learnt (tests, simulations): a plain step of one row costs `plain`, each further
        verify token `token`, a draft forward `draft` per row at `block_size` positions (fewer: proportionally less)."""
        times = cls(block_size)
        times.theta = np.array([plain - token, 0.0, token, 0.0, draft / block_size])
        times.spread, times.learns, times.level = np.zeros((len(PRIOR), len(PRIOR))), False, plain
        return times

    def cycle_seconds(self, tokens: int, rows: int = 1, drafted: bool = True, block: int | None = None,
                      draft_rows: int | None = None) -> float:
        """A cycle's seconds as plans price it: the estimate less EXPLORE deviations, at least CHEAPEST of it."""
        key = (tokens, rows, drafted, block, draft_rows)
        seconds = self._memo.get(key)
        if seconds is None:
            x = features(tokens, rows, drafted, block, draft_rows, self.block_size)
            estimate = float(self.theta @ x)
            seconds = self._memo[key] = max(estimate - EXPLORE * self.deviation(x), CHEAPEST * estimate)
        return seconds

    def deviation(self, x: np.ndarray) -> float:
        """The standard deviation of the estimated seconds of shape x."""
        return float(np.sqrt(max(float(x @ self.spread @ x), 0.0)))

    def observe(self, tokens: int, rows: int, drafted: bool, seconds: float, block: int | None = None,
                draft_rows: int | None = None) -> bool:
        """A cycle of this shape took `seconds`. Returns whether it was learnt (not a time that is not positive)."""
        if not self.learns or not seconds > 0:
            return False
        x = features(tokens, rows, drafted, block, draft_rows, self.block_size)
        miss = seconds / max(float(self.theta @ x), 1e-12)
        changed = self.observed < LEVEL_CYCLES or self.observed % REFRESH == 0  # (re-price the shapes)
        if not self.observed or (self.observed < LEVEL_CYCLES and not 1 / LEVEL_MISS < miss < LEVEL_MISS):
            # the level: the prior's plain steps become seconds (the whole model scaled, its shape kept)
            self.theta, self.spread, self.level = self.theta * miss, self.spread * miss ** 2, self.level * miss
        else:  # each term drifts between cycles
            self.spread = self.spread + np.diag((DRIFT * np.maximum(self.theta, 0.1 * self.scale)) ** 2)
        predicted = max(float(self.theta @ x), 1e-12)
        off = max(seconds / predicted, predicted / seconds)
        noise = (self.noise * predicted * max(1.0, off / OUTLIER)) ** 2
        px = self.spread @ x
        expected = float(x @ px) + (self.noise * predicted) ** 2
        self.surprise += SURPRISE_SMOOTHING * (min((seconds - predicted) ** 2 / expected, 25.0) - self.surprise)
        if self.observed and self.surprise > SURPRISE:  # (the machine changed: what was learnt is less sure)
            self.spread, changed = 2 * self.spread, True
            # (no term less sure than the prior was of it: jitter that inflates again and again leaves it at that)
            limit = PRIOR_SD * np.maximum(self.theta, FLOOR * PRIOR * self.level)
            shrink = np.minimum(1.0, limit / np.sqrt(np.maximum(np.diag(self.spread), 1e-30)))
            self.spread = self.spread * np.outer(shrink, shrink)
            px = self.spread @ x
        gain = px / (float(x @ px) + noise)
        self.theta = np.maximum(self.theta + gain * (seconds - predicted), FLOOR * PRIOR * self.level)
        # (Joseph's form of P - K x'P: it stays a covariance in floating point, where timings as noisy as a machine
        # time-slicing between processes drove the short form indefinite and the model to seconds a step)
        keep = np.eye(len(x)) - np.outer(gain, x)
        self.spread = keep @ self.spread @ keep.T + noise * np.outer(gain, gain)
        if self.surprise <= SURPRISE:  # (a machine that changed misses by more than its noise: not learnt as noise)
            miss = min(((seconds - predicted) / predicted) ** 2, (OUTLIER * self.noise) ** 2)
            self.noise = max(NOISE, float(np.sqrt(self.noise ** 2 + NOISE_SMOOTHING * (miss - self.noise ** 2))))
        self.observed += 1
        if changed:
            self._memo.clear()
        return True

    @property
    def scale(self) -> np.ndarray:
        """The prior at the level measured (the least each term's drift is sized by)."""
        return PRIOR * self.level
