"""Online corrections of a device profile (dflash/core/costs.py), per cycle shape, from the cycles the engine ran.

A profile measured while another process held the core (a plain step of 120 ms where it takes 11) would otherwise
be trusted forever. Every cycle the engine times gives the ratio of its wall time to what the profile predicts for
its shape (drafted or not, rows and tokens per row in power-of-two buckets). A shape's first ratio becomes its
factor and later ones move it by an exponential moving average; the factor multiplies the profile's prediction for
that shape from then on, so a shape the engine runs is repaired within a few dozen cycles even when its cycles are
noisy. A shape not run yet takes the average over all cycles: a profile that is off everywhere (measured under
load) keeps its shapes' proportions instead of making the shapes run so far look cheap beside the others. The
factors are written next to the profile every SAVE_EVERY observations and read back with it, as a starting guess
only: a shape's first cycle in this process replaces what an earlier process learnt (which may have been a busy
hour's), so one run's drift never outlives the next run's first cycle of that shape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SMOOTHING = 0.2  # weight of one cycle's ratio in its shape's factor
# a cycle's ratio outside these is dropped: a cycle that compiled a graph (seconds, where a forward takes
# milliseconds) or stalled on a page fault says nothing of the device
LIMITS = (0.02, 50.0)
SAVE_EVERY = 64  # observations between writes of the factors
ALL = "all"  # the factor of every cycle, for shapes not run yet


def bucket(n: int) -> int:
    """n rounded up to a power of two (1, 2, 4, 8 ...)."""
    return 1 << max(n - 1, 0).bit_length()


class Corrections:
    """shape -> measured / predicted seconds, averaged over the cycles of that shape (1.0 for a shape not seen)."""

    def __init__(self, factors: dict[str, float] | None = None, path: Path | None = None,
                 smoothing: float = SMOOTHING):
        self.factors = dict(factors or {})
        self.path, self.smoothing = path, smoothing
        self.observed = 0  # cycles seen (since load)
        self.learnt: set[str] = set()  # keys observed in this process (the others' factors are an earlier run's)

    @staticmethod
    def key(tokens: int, rows: int, drafted: bool) -> str:
        return f"{'draft' if drafted else 'plain'}:{bucket(rows)}x{bucket(tokens)}"

    def overall(self) -> float | None:
        """Wall time over the profile's predictions, averaged over every cycle seen (None before the first)."""
        return self.factors.get(ALL)

    def factor(self, tokens: int, rows: int, drafted: bool) -> float:
        return self.factors.get(self.key(tokens, rows, drafted), self.factors.get(ALL, 1.0))

    def observe(self, tokens: int, rows: int, drafted: bool, predicted: float, seconds: float) -> None:
        """One cycle of this shape took `seconds` where the uncorrected profile predicted `predicted`."""
        if predicted <= 0 or seconds <= 0:
            return
        ratio = seconds / predicted
        if not LIMITS[0] <= ratio <= LIMITS[1]:
            return
        for key in (self.key(tokens, rows, drafted), ALL):
            old = self.factors.get(key) if key in self.learnt else None
            self.factors[key] = ratio if old is None else old + self.smoothing * (ratio - old)
            self.learnt.add(key)
        self.observed += 1
        if self.observed % SAVE_EVERY == 0:
            self.save()

    def save(self) -> None:
        """Write the factors to `path` (if any; a failed write is not the engine's problem: they are kept in memory)."""
        if self.path is None or not self.factors:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.factors))
            tmp.replace(self.path)
        except OSError:
            pass

    @classmethod
    def load(cls, path: Path) -> Corrections:
        """The factors saved at `path` (none if it is missing or damaged), saved there from now on."""
        try:
            factors = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            factors = {}
        return cls({k: v for k, v in factors.items() if LIMITS[0] <= v <= LIMITS[1]}, path)
