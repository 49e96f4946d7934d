"""Everything the core keeps per row. A batch is a list of Rows in the caches' row order, so joining, retiring and
reordering rows is one list operation on the engine (admit, retire), and a lone sequence is a batch of one. What lives
in the backend's arrays per row (K/V slots, the drafter's context, the target features the drafter has not read yet)
is moved by the same operation through the backend's primitives (Target.select / merge, Drafter.select / merge,
PendingFeatures.select / add_row).

The pending features are kept as the cycles committed them and joined once, when a draft (or an absorb) takes them:
a cycle without a draft forward (a plain step, or copied nodes alone) appends its part (a view of the verify
forward's features), and the join is one concatenation, plus one gather where rows kept different numbers of
positions, at the draft that reads them (joining after every such cycle would copy everything pending every cycle,
work a plain decoder does not do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .budget import Pause
from .contract import Pending
from .sampling import RowSampling
from .tree import CopyIndex

if TYPE_CHECKING:
    from .contract import Target


@dataclass
class Row:
    tokens: list[int]  # ids whose K/V is in the target cache
    sampling: RowSampling  # its settings, acceptance rule, noise seed and proposal-shape chooser
    copies: CopyIndex = field(default_factory=CopyIndex)  # prompt lookup over its tokens (the copied branch)
    pause: Pause = field(default_factory=Pause)  # auto: its own pause from the draft forward

    def copied(self, anchor: int, length: int) -> list[int]:
        """Its branch copied from its context (prompt lookup), brought up to `anchor`: at most `length` tokens."""
        self.copies.update(self.tokens + [anchor])
        return self.copies.continuation(length)


class PendingFeatures:
    """Parts (rows, w, K*H) in commit order; row i's first counts[i] positions of each part are real."""

    def __init__(self) -> None:
        self.parts: list[Pending] = []
        self.counts: list[int] = []  # per row, over every part

    def __bool__(self) -> bool:
        return bool(self.parts)

    def add(self, part: Pending) -> None:
        self.parts.append(part)
        self.counts = list(part.counts) if len(self.parts) == 1 else [a + b for a, b in
                                                                      zip(self.counts, part.counts)]

    def set(self, pending: Pending | None) -> None:
        """Replace everything pending with `pending` (None: nothing)."""
        self.parts, self.counts = [], []
        if pending is not None:
            self.add(pending)

    def take(self, target: Target) -> Pending | None:
        """Everything pending as one Pending (None if nothing is), and nothing pending after."""
        joined = self.peek(target)
        self.set(None)
        return joined

    def select(self, rows: list[int], target: Target) -> None:
        """Keep these rows' pending features, in this order (rows retired or reordered)."""
        joined = self.peek(target)
        if joined is not None:
            self.set(Pending(target.take_rows(joined.features, rows), [joined.counts[i] for i in rows]))

    def add_row(self, target: Target) -> None:
        """A row joined the batch with nothing pending."""
        joined = self.peek(target)
        if joined is not None:
            self.set(Pending(target.pad_rows(joined.features, 1), joined.counts + [0]))

    def crop(self, n: int, target: Target) -> None:
        """A lone row keeps at most its first n pending positions (its cache was cropped)."""
        joined = self.peek(target)
        if joined is not None and n < joined.counts[0]:
            self.set(Pending(target.head(joined.features, n), [n]))

    def peek(self, target: Target) -> Pending | None:
        """Everything pending as one Pending; it stays pending (as that one part)."""
        if len(self.parts) > 1:
            self.set(join(self.parts, target))
        return self.parts[0] if self.parts else None


def join(parts: list[Pending], target: Target) -> Pending:
    """Parts in order as one Pending: row i's real positions of every part, packed to the left."""
    widths = [p.features.shape[1] for p in parts]
    features = target.cat([p.features for p in parts])
    counts = [sum(row) for row in zip(*(p.counts for p in parts))]
    # a row that kept fewer positions of a part than its width, before the last part: gather its real ones
    if any(c != w for p, w in zip(parts[:-1], widths) for c in p.counts):
        starts = [sum(widths[:j]) for j in range(len(parts))]
        slots = [[s + k for s, p in zip(starts, parts) for k in range(p.counts[r])] or [0]
                 for r in range(len(counts))]
        features = target.gather(features, slots)
    return Pending(features, counts)
