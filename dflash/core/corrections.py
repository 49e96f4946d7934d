"""Online corrections of a device profile (dflash/core/costs.py), per cycle shape, from the cycles the engine ran.

A profile measured while another process held the core (a plain step of 120 ms where it takes 11) would otherwise
be trusted forever. Every cycle the engine times gives the ratio of its wall time to what the profile predicts for
its shape (drafted or not, rows and tokens per row in power-of-two buckets), and moves two factors: its shape's and
the average over all cycles, which shapes not run yet take (a profile that is off everywhere keeps its shapes'
proportions instead of making the shapes run so far look cheap beside the others). A shape's first cycle in a
process only warms up (a new tree width allocates and builds its graphs). The process's first timed cycle sets the
average, so a profile off by 10x is repaired at once; from then on a factor moves by an exponential moving average
of logarithms (a shape's starting from the average) whose step is capped at MAX_STEP, so one stalled cycle (a page
fault, a collection, another process's burst) moves it by at most that.

Averaged plainly and carried from run to run, stalled cycles made one shape's factor 13x where the others' were near
1: auto then never chose that shape again, so its factor was never corrected, was saved, and priced the shape out
of later runs too (two runs of the same MLX bench with carried factors: `auto` 2.59x and 2.02x plain). So the
factors are written next to the profile every SAVE_EVERY observations (at most once per SAVE_SECONDS), but only the
average is read back (a starting guess, replaced by this process's first timed cycle; the profile is measured again
at load when it is far off, costs.py).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

SMOOTHING = 0.2  # weight of one cycle's (log) ratio in a factor
MAX_STEP = 1.25  # the most one cycle moves a factor (times or over)
# a cycle's ratio outside these is dropped: a cycle that compiled a graph (seconds, where a forward takes
# milliseconds) or stalled on a page fault says nothing of the device
LIMITS = (0.02, 50.0)
SAVE_EVERY = 64  # observations between writes of the factors ...
SAVE_SECONDS = 10.0  # ... and at least this long (a write takes ~0.7 ms: every 64 cycles it cost a small model's
# decoding ~0.15%)
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
        self.saved_at = -math.inf  # time.monotonic() of the last write
        self.warm: set[str] = set()  # shapes whose first cycle in this process has run (it is not learnt)

    @staticmethod
    @functools.cache  # (asked twice a cycle, of a few shapes)
    def key(tokens: int, rows: int, drafted: bool, block: int | None = None) -> str:
        """`block`: a draft forward shorter than the whole block, whose cycles are their own shape (they run on a
        tree's path, whose host work a full block's chain cycles do not pay)."""
        shape = f"{'draft' if drafted else 'plain'}:{bucket(rows)}x{bucket(tokens)}"
        return f"{shape}@{block}" if block is not None else shape

    def overall(self) -> float | None:
        """Wall time over the profile's predictions, averaged over every cycle seen (None before the first)."""
        return self.factors.get(ALL)

    def factor(self, tokens: int, rows: int, drafted: bool, block: int | None = None) -> float:
        return self.factors.get(self.key(tokens, rows, drafted, block), self.factors.get(ALL, 1.0))

    def observe(self, tokens: int, rows: int, drafted: bool, predicted: float, seconds: float,
                block: int | None = None) -> bool:
        """One cycle of this shape took `seconds` where the uncorrected profile predicted `predicted`. Returns whether
        it was learnt (not a shape's warm-up, not a cycle outside LIMITS): what says something of the device."""
        if predicted <= 0 or seconds <= 0:
            return False
        ratio = seconds / predicted
        if not LIMITS[0] <= ratio <= LIMITS[1]:
            return False
        shape = self.key(tokens, rows, drafted, block)
        if shape not in self.warm:
            self.warm.add(shape)
            return False
        cap = math.log(MAX_STEP)
        # the average this process learnt before this cycle (a loaded one is only a guess); a shape's factor is
        # always this process's (load reads back the average alone)
        level = self.factors.get(ALL) if self.observed else None
        for key, old in ((shape, self.factors.get(shape, level)), (ALL, level)):
            if old is None:  # (this process's first timed cycle)
                self.factors[key] = ratio
            else:
                step = self.smoothing * math.log(ratio / old)
                self.factors[key] = old * math.exp(min(max(step, -cap), cap))
        self.observed += 1
        if self.observed % SAVE_EVERY == 0 and time.monotonic() - self.saved_at >= SAVE_SECONDS:
            self.save()
        return True

    def save(self) -> None:
        """Write the factors to `path` (if any; a failed write is not the engine's problem: they are kept in memory)."""
        if self.path is None or not self.factors:
            return
        self.saved_at = time.monotonic()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.factors))
            tmp.replace(self.path)
        except OSError:
            pass

    @classmethod
    def load(cls, path: Path) -> Corrections:
        """The average factor saved at `path` (none if it is missing or damaged; the shapes' factors are this
        process's to learn), saved there from now on."""
        try:
            factors = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            factors = {}
        average = factors.get(ALL)
        return cls({ALL: average} if average is not None and LIMITS[0] <= average <= LIMITS[1] else {}, path)
