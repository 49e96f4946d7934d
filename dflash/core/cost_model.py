"""What a cycle costs in seconds, as --verify auto predicts it: Costs, the device profile (dflash/core/costs.py
measures it at load) read at any rows, tokens, context and draft block, with its online per-shape corrections
(dflash/core/corrections.py); and CycleClock, fitted on the cycles' own wall times, from the profile's seconds to the
wall clock's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .corrections import Corrections

MEMO_SIZE = 4096  # Costs: answers kept


def interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Linear between measured (x, seconds) points, flat below the first, extrapolated from the last two beyond the
    last (never decreasing)."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, t0), (x1, t1) in zip(points, points[1:]):
        if x <= x1:
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
    (x0, t0), (x1, t1) = points[-2:] if len(points) > 1 else (points[0], (points[0][0] + 1, points[0][1]))
    return t1 + max(t1 - t0, 0.0) * (x - x1) / (x1 - x0)


@dataclass
class Costs:
    """Seconds on this device: one draft forward and one target forward of n tokens after `context` cached positions,
    for one row (`draft`, `verify`) and, where the backend batches, for r rows of n tokens each (`batch`: r -> points,
    `draft_batch`: r -> seconds), measured at a few r and n. Without batch points, r rows of n tokens cost what one
    row of r * n tokens does and r drafts cost r single ones (a CPU pays for every token; a GPU below its compute
    knee does not, which only the batch points show). `longer` is the same profile after a longer context: every
    token attends to every cached position, so at a serving load's contexts a forward can cost twice what it costs
    after a short one; a cost at `context` positions is interpolated between the two (linear past the longer)."""

    draft: float
    verify: list[tuple[int, float]]  # (tokens, seconds), increasing tokens
    batch: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # rows -> (tokens per row, seconds)
    draft_batch: dict[int, float] = field(default_factory=dict)  # rows -> seconds of one draft forward
    context: int = 64  # positions cached before the measured forwards
    longer: Costs | None = None  # the same forwards after more cached positions
    # draft forwards of fewer positions than the block: block -> rows -> seconds (the largest block: the full one).
    # The drafter's work grows with the positions it fills; without points a shorter draft costs a full one
    draft_blocks: dict[int, dict[int, float]] = field(default_factory=dict)

    # per cycle shape, the wall clock over the profile, learnt from the cycles the engine ran (persisted with it)
    corrections: Corrections = field(default_factory=Corrections, repr=False, compare=False)
    # answers already given: a cycle's plan asks the same few dozen questions (one batch, one context) many times
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def verify_seconds(self, tokens: int, rows: int = 1, context: float | None = None) -> float:
        return self._remember(("verify", tokens, rows, context),
                              lambda: self._at(context, lambda c: c._verify(tokens, rows)))

    def draft_seconds(self, rows: int = 1, context: float | None = None, block: int | None = None) -> float:
        """One draft forward of `block` positions (default: the whole block) for `rows` rows."""
        return self._remember(("draft", rows, context, block),
                              lambda: self._at(context, lambda c: c._draft(rows)) * self._block_share(block, rows))

    def _remember(self, key: tuple, seconds) -> float:
        answer = self._memo.get(key)
        if answer is None:
            if len(self._memo) >= MEMO_SIZE:  # (contexts grow: old ones are not asked again)
                self._memo.clear()
            answer = self._memo[key] = seconds()
        return answer

    def cycle_seconds(self, tokens: int, rows: int = 1, drafted: bool = True, context: float | None = None,
                      block: int | None = None, draft_rows: int | None = None) -> float:
        """A cycle's forwards: the draft forward (of `block` positions, for `draft_rows` of the rows: default all)
        when `drafted`, then a target forward of `tokens` per row."""
        return self.corrections.factor(tokens, rows, drafted, self._short(block, drafted)) * \
            self.measured_cycle(tokens, rows, drafted, context, block, draft_rows)

    def measured_cycle(self, tokens: int, rows: int = 1, drafted: bool = True, context: float | None = None,
                       block: int | None = None, draft_rows: int | None = None) -> float:
        """cycle_seconds as the profile measured it, before the online corrections."""
        draft = self.draft_seconds(draft_rows or rows, context, block) if drafted else 0.0
        return self.verify_seconds(tokens, rows, context) + draft

    def observe(self, tokens: int, rows: int, drafted: bool, seconds: float, context: float | None = None,
                block: int | None = None, draft_rows: int | None = None) -> bool:
        """A cycle of this shape took `seconds` on the wall clock: its shape's correction learns from it. Returns
        whether it did (Corrections.observe: not a warm-up, not a stall)."""
        return self.corrections.observe(tokens, rows, drafted,
                                        self.measured_cycle(tokens, rows, drafted, context, block, draft_rows),
                                        seconds, self._short(block, drafted))

    def _short(self, block: int | None, drafted: bool) -> int | None:
        """A drafted cycle's `block` if it is a measured draft block shorter than the whole one (its correction's
        shape), else None."""
        if not drafted or block is None or not self.draft_blocks or block >= max(self.draft_blocks):
            return None
        return block

    def _block_share(self, block: int | None, rows: int) -> float:
        """A draft of `block` positions over one of the whole block, at `rows` rows (measured at a few blocks)."""
        if block is None or not self.draft_blocks or block >= max(self.draft_blocks):
            return 1.0
        at = {b: interpolate(sorted(points.items()), rows) for b, points in self.draft_blocks.items()}
        full = at[max(at)]
        return interpolate([(b, at[b] / full) for b in sorted(at)], block)

    def _at(self, context: float | None, seconds) -> float:
        near = seconds(self)
        if context is None or self.longer is None or context <= self.context:
            return near
        growth = max(seconds(self.longer) - near, 0.0) / (self.longer.context - self.context)
        return near + growth * (context - self.context)

    def _verify(self, tokens: int, rows: int) -> float:
        if rows == 1 or not self.batch:
            return interpolate(self.verify, rows * tokens)
        widest = min(points[-1][0] for points in self.batch.values())
        curves = [(1, self.verify), *sorted(self.batch.items())]
        seconds = interpolate([(r, interpolate(points, min(tokens, widest))) for r, points in curves], rows)
        if tokens > widest:  # past the batch points: extra tokens cost what they add to one row's longer forward
            seconds += interpolate(self.verify, rows * tokens) - interpolate(self.verify, rows * widest)
        return seconds

    def _draft(self, rows: int) -> float:
        if rows == 1 or not self.draft_batch:
            return self.draft * rows
        return interpolate([(1, self.draft), *sorted(self.draft_batch.items())], rows)

    def to_json(self) -> dict:
        return {"draft_seconds": self.draft, "verify_seconds": [list(p) for p in self.verify],
                "batch_verify_seconds": {str(r): [list(p) for p in pts] for r, pts in self.batch.items()},
                "batch_draft_seconds": {str(r): t for r, t in self.draft_batch.items()}, "context": self.context,
                "draft_block_seconds": {str(b): {str(r): t for r, t in pts.items()}
                                        for b, pts in self.draft_blocks.items()},
                **({"longer": self.longer.to_json()} if self.longer is not None else {})}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        points = lambda pts: [(int(n), float(t)) for n, t in pts]  # noqa: E731
        return cls(float(d["draft_seconds"]), points(d["verify_seconds"]),
                   {int(r): points(pts) for r, pts in d.get("batch_verify_seconds", {}).items()},
                   {int(r): float(t) for r, t in d.get("batch_draft_seconds", {}).items()}, int(d.get("context", 64)),
                   cls.from_json(d["longer"]) if "longer" in d else None,
                   {int(b): {int(r): float(t) for r, t in pts.items()}
                    for b, pts in d.get("draft_block_seconds", {}).items()})


class CycleClock:
    """What a cycle really takes, from what the profile says its forwards take: k * forwards + a, fitted online over
    recent cycles by exponentially weighted least squares. k carries what the profile under-counts in proportion to
    the work (more rows than its batches, a second thread of the process such as a server's event loop), a the host
    work per cycle (the heap, the walk, sampling). While the cycles' forwards barely vary (one shape), a ridge towards
    the prior k leaves the difference to a, as a plain mean of the excess; once shapes vary, the slope is measured."""

    def __init__(self, smoothing: float = 0.1, ridge: float = 0.01, k: float = 1.0, a: float = 0.0):
        self.smoothing, self.ridge, self.prior = smoothing, ridge, k
        self.sums = [0.0] * 5  # decayed means of 1, x, x^2, y, x*y (x: the profile's seconds, y: the measured)
        self.k, self.a = k, a

    def __call__(self, forwards: float) -> float:
        return max(self.k * forwards + self.a, 0.1 * forwards)

    def observe(self, forwards: float, seconds: float) -> None:
        x, y, s = forwards, seconds, self.smoothing
        self.sums = [m + s * (v - m) for m, v in zip(self.sums, (1.0, x, x * x, y, x * y))]
        w, sx, sxx, sy, sxy = self.sums
        # minimise sum w (y - kx - a)^2 + r sxx (k - prior)^2:
        # [[sxx (1 + r), sx], [sx, w]] [k, a] = [sxy + r sxx prior, sy]
        a11, b1 = sxx * (1 + self.ridge), sxy + self.ridge * sxx * self.prior
        det = a11 * w - sx * sx
        if det <= 0:
            return
        self.k = max((w * b1 - sx * sy) / det, 0.0)
        self.a = (sy - self.k * sx) / w  # (the fit's a for this k: the mean excess, also where k stopped at 0)
