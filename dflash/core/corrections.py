"""Online corrections of a device profile (dflash/core/costs.py), per cycle shape, from the cycles the engine ran.

A profile measured while another process held the core (a plain step of 120 ms where it takes 11) would otherwise
be trusted forever. Every cycle the engine times gives the ratio of its wall time to what the profile predicts for
its shape (drafted or not, rows and tokens per row in power-of-two buckets). A shape's first cycle in a process only
warms up (a new tree width allocates and builds its graphs). Its next ratio becomes its factor, so a profile off by
10x is repaired at a shape's second cycle; later ratios move the factor by an exponential moving average of
logarithms whose step is capped at MAX_STEP, so one stalled cycle (a page fault, a collection, another process's
burst) moves it by at most that. Averaged plainly, stalled cycles made one shape's factor 13x where the others' were
near 1: auto then never chose that shape again, so its factor was never corrected, was saved, and priced the shape
out of later runs too (the reference pair on MLX: 2.02x plain where the run before gave 2.59x).

A shape not run yet takes the average over all cycles: a profile that is off everywhere (measured under load) keeps
its shapes' proportions instead of making the shapes run so far look cheap beside the others. The factors are
written next to the profile every SAVE_EVERY observations and read back with it as a starting guess only: a shape's
first timed cycle in this process replaces what an earlier process learnt (which may have been a busy hour's), and a
saved factor further than MAX_SPREAD times from the saved average is read back at that bound, so a shape that one
run priced out of its plans is tried again in the next.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

SMOOTHING = 0.2  # weight of one cycle's (log) ratio in its shape's factor
MAX_STEP = 1.25  # the most one cycle moves a factor (times or over)
MAX_SPREAD = 2.0  # a saved shape's factor is read back within this many times the saved average
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
        self.warm: set[str] = set()  # shapes whose first cycle in this process has run (it is not learnt)

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
        shape = self.key(tokens, rows, drafted)
        if shape not in self.warm:
            self.warm.add(shape)
            return
        cap = math.log(MAX_STEP)
        for key in (shape, ALL):
            old = self.factors.get(key) if key in self.learnt else None
            if old is None:
                self.factors[key] = ratio
            else:
                step = self.smoothing * math.log(ratio / old)
                self.factors[key] = old * math.exp(min(max(step, -cap), cap))
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
        factors = {k: v for k, v in factors.items() if LIMITS[0] <= v <= LIMITS[1]}
        average = factors.get(ALL)
        if average is not None:
            factors = {k: min(max(v, average / MAX_SPREAD), average * MAX_SPREAD) for k, v in factors.items()}
        return cls(factors, path)
