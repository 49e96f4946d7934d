"""A row joining a running batch between cycles (Engine.begin_admit, Engine.end_admit).

Its prompt is prefilled, a chunk per Admission.advance(), into a one-row engine of its own: a kept prefix's caches, or
empty ones on the same models. Nothing of the batch's is touched until the prompt is in, so a caller can interleave
the prefill with the batch's cycles and a failed prefill leaves the batch as it was. Joining then appends the row's
target and drafter caches to the batch's, both or neither.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .contract import Pending
from .errors import DFlashError
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine


class Admission:
    """A row being prefilled into caches of its own before it joins `engine`'s batch."""

    def __init__(self, engine: Engine, prompt_ids: list[int], sampling: SamplingParams | None = None,
                 chunk: int | None = None, generated: int = 0):
        self.engine, self.prompt_tokens = engine, len(prompt_ids)
        self.started = time.perf_counter()
        self.first: int | None = None  # its first token, once the whole prompt is in
        cache = engine.prefix_cache
        row = (cache.take(prompt_ids) if cache is not None else None) or engine.spawn()
        row.prefill_chunk = chunk or engine.prefill_chunk
        row.logprobs, row.verify_mode = engine.logprobs, engine.verify_mode
        row.set_sampling(sampling or engine.sampling)
        self.row = row
        self._chunks = row.prefill_chunks(prompt_ids, generated)

    def advance(self) -> bool:
        """Prefill the next chunk; True once the prompt is in."""
        if self.first is None:
            self.first = next(self._chunks)
        return self.first is not None

    def join(self, alone: bool = False) -> int:
        """Merge the prefilled row into the engine's batch; `alone`: the batch emptied meanwhile (a finished lone
        sequence may still be cached), so the row's caches become the engine's. Returns its first token."""
        engine, row = self.engine, self.row
        if self.first is None:
            raise DFlashError("end_admit: the row's prefill has not finished")
        engine.first_logprobs, engine.last_reused = row.first_logprobs, row.last_reused
        if alone or not engine.rows:
            if engine.rows and not engine.shared:
                engine.keep_prefix(0)  # (the finished sequence, for later prompts)
            engine.target, engine.drafter, engine.pending, engine._copies = row.target, row.drafter, row.pending, []
            engine.rows, engine.row_sampling, engine.shared = row.rows, row.row_sampling, False
            return self.first
        before = len(engine.rows)
        engine.shared = True  # (from here on the caches are in rows mode, even if the drafter's merge fails)
        engine.target.merge(row.target)
        if engine.drafter is not None:
            try:
                assert row.drafter is not None  # (spawned from the engine's)
                engine.drafter.merge(row.drafter)
            except Exception:
                engine.target.select(list(range(before)))  # all or nothing: the target's new row goes again
                raise
            if engine.pending is not None:
                engine.pending = Pending(engine.target.pad_rows(engine.pending.features, 1),
                                         engine.pending.counts + [0])
        engine.rows.append(row.rows[0])
        engine.row_sampling.append(row.row_sampling[0])
        return self.first
