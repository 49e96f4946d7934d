"""A row joining a running batch between cycles (Engine.begin_admit, Engine.end_admit).

Its prompt is prefilled, a chunk per Admission.advance(), into a one-row engine of its own: a kept prefix's caches, or
empty ones on the same models. Nothing of the batch's is touched until the prompt is in, so a caller can interleave
the prefill with the batch's cycles and a failed prefill leaves the batch as it was. Engine.end_admit then appends
the row's target and drafter caches to the batch's, both or neither.
"""

from __future__ import annotations

import time
from typing import Generic, Iterator, TypeVar

from .contract import Drafter, Target

Row = TypeVar("Row")


class Admission(Generic[Row]):
    """A row being prefilled into caches of its own: `row` (the one-row engine that holds them) and its prefill,
    `chunks` (None after every chunk but the last, then the row's first token)."""

    def __init__(self, row: Row, chunks: Iterator[int | None], prompt_tokens: int):
        self.row, self.prompt_tokens = row, prompt_tokens
        self.started = time.perf_counter()
        self.first: int | None = None  # its first token, once the whole prompt is in
        self._chunks = chunks

    def advance(self) -> bool:
        """Prefill the next chunk; True once the prompt is in."""
        if self.first is None:
            self.first = next(self._chunks)
        return self.first is not None


def join_caches(target: Target, drafter: Drafter | None, row_target: Target, row_drafter: Drafter | None,
                rows: int) -> None:
    """Append a prefilled row's target and drafter caches to those of a batch of `rows` rows: both or neither."""
    target.merge(row_target)
    if drafter is not None:
        try:
            assert row_drafter is not None  # (spawned from the batch's)
            drafter.merge(row_drafter)
        except Exception:
            target.select(list(range(rows)))  # all or nothing: the target's new row goes again
            raise
