"""Everything the core keeps per row, in one place. A batch is a list of Rows in the caches' row order, so joining,
retiring and reordering rows is one list operation on the engine (admit, retire), and a lone sequence is a batch of
one. What lives in the backend's arrays per row (K/V slots, the drafter's context, the pending target features) is
moved by the same operation through the backend's primitives (Target.select / merge, Drafter.select / merge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .budget import Pause
from .sampling import RowSampling
from .tree import CopyIndex


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
