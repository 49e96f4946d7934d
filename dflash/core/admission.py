"""How a prompt's row gets into an engine: a lone prefill (a chat's next turn reusing its cached prefix, or a kept
prefix's caches), and a row joining a running batch between cycles (Engine.begin_admit, Engine.end_admit).

A joining row's prompt is prefilled, a chunk per Admission.advance(), into a one-row engine of its own: a kept
prefix's caches, or empty ones on the same models. Nothing of the batch's is touched until the prompt is in, so a
caller can interleave the prefill with the batch's cycles and a failed prefill leaves the batch as it was;
Engine.end_admit then appends the row's target and drafter caches to the batch's, both or neither.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, Sequence

from .contract import Drafter, Pending, Target
from .errors import DFlashError
from .lookahead import lands
from .rows import PendingFeatures, Row as BatchRow
from .sampling import RowSampling, SamplingParams, common_prefix

if TYPE_CHECKING:
    from .cycle import CycleClock
    from .lookahead import Lookahead
    from .policy import Policy
    from .prefix_cache import PrefixCache
    from .sampling import RowDraw


class Admission:
    """A row being prefilled into caches of its own: `row` (the one-row engine that holds them) and its prefill,
    `chunks` (None after every chunk but the last, then the row's first token)."""

    def __init__(self, row: Prefill, chunks: Iterator[int | None], prompt_tokens: int):
        self.row, self.prompt_tokens = row, prompt_tokens
        self.started = time.perf_counter()
        self.first: int | None = None  # its first token, once the whole prompt is in
        self._chunks = chunks

    def advance(self) -> bool:
        """Prefill the next chunk; True once the prompt is in."""
        if self.first is None:
            self.first = next(self._chunks)
        return self.first is not None


def check_fits(prompt_ids: Sequence[int], max_context: int | None) -> None:
    """One line when a prompt leaves no room in the target's context for a new token."""
    if max_context and len(prompt_ids) >= max_context:
        raise DFlashError(f"prompt: {len(prompt_ids)} tokens do not fit the target's context "
                          f"(max_position_embeddings {max_context})")


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


class Prefill:
    """The engine's prefill and admission (dflash.core.engine.Engine inherits them): a lone prompt's chunks, and a
    joining row's, over the engine's state and its cycle's sample."""

    if TYPE_CHECKING:  # (the engine's, which these methods share)
        target: Target
        drafter: Drafter | None
        batch: list[BatchRow]
        shared: bool
        queue: PendingFeatures
        sampling: SamplingParams
        logprobs: int | None
        first_logprobs: tuple[list[float], list[list[tuple[int, float]]]] | None
        prefix_cache: PrefixCache | None
        last_reused: int
        policy: Policy
        lookahead: Lookahead
        clock: CycleClock
        prefill_chunk: int
        max_context: int | None
        @property
        def tokens(self) -> list[int]: ...
        @property
        def rows(self) -> list[list[int]]: ...
        @property
        def pending(self) -> Pending | None: ...
        @property
        def verify_mode(self) -> str: ...
        def spawn(self) -> Prefill: ...
        def reset(self) -> None: ...
        def crop(self, length: int) -> None: ...
        def keep_prefix(self, i: int) -> None: ...
        def set_sampling(self, params: SamplingParams) -> None: ...
        def absorb_pending(self) -> None: ...
        def row_draws(self, width: int, offset: int = 1, noise: int | None = None) -> list[RowDraw] | None: ...
        def sample(self, logits, block, paths=None, draws=None, draft=None): ...

    def _adopt_prefix(self, prompt_ids: list[int]) -> None:
        """Before a lone prefill: take the kept prefix that beats the caches' own (keeping theirs if it is lost)."""
        if self.prefix_cache is None:
            return
        own = common_prefix(self.tokens, prompt_ids[:-1])
        if self.batch and len(self.tokens) - own >= self.prefix_cache.min_tokens:
            self.keep_prefix(0)
        row = self.prefix_cache.take(prompt_ids, at_least=own)
        if row is not None:
            self._take_caches(row, pending=None)

    def _take_caches(self, row: Prefill, pending: Pending | None) -> None:
        """A one-row engine's caches (a kept prefix, or a row admitted alone) become this engine's."""
        self.target, self.drafter, self.batch, self.shared = row.target, row.drafter, row.batch, False
        self.queue.set(pending)
        self.policy.reset()

    # ---- prefill ---------------------------------------------------------------------------------------------------
    @lands
    def prefill(self, prompts: Sequence[Sequence[int]],
                samplings: Sequence[SamplingParams | None] | None = None) -> list[int]:
        """Feed the prompts and return each row's first token. One prompt reuses the longest cached prefix (a chat's
        earlier turns); several start a fresh batch, one admitted row each. samplings: row i's own settings."""
        for p in prompts:
            check_fits(p, self.max_context)
        samplings = list(samplings) if samplings is not None else [None] * len(prompts)
        if len(prompts) == 1 and not self.shared:
            return [self._prefill_alone(list(prompts[0]), samplings[0])]
        self.reset()
        return [self.admit(p, s) for p, s in zip(prompts, samplings)]

    @lands
    def admit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, generated: int = 0) -> int:
        """A new row joins the running batch between cycles: its prompt is prefilled alone, then its caches are
        appended to the batch's. It samples with `sampling` (default: the engine's). `generated`: the last that many
        ids are the row's own output already (a row rebuilt from its committed tokens). Returns its first token."""
        prompt_ids = list(prompt_ids)
        check_fits(prompt_ids, self.max_context)
        if not self.rows:
            return self._prefill_alone(prompt_ids, sampling, generated)
        admission = self.begin_admit(prompt_ids, sampling, generated=generated)
        while not admission.advance():
            pass
        return self.end_admit(admission)

    def begin_admit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                    chunk: int | None = None, generated: int = 0) -> Admission:
        """admit() in steps, for a caller that interleaves a joining prompt with the batch's cycles: the prompt is
        prefilled `chunk` tokens per Admission.advance() into a one-row engine of its own (a kept prefix's caches, or
        empty ones on the same models: dflash/core/admission.py), then end_admit merges it."""
        prompt_ids = list(prompt_ids)
        check_fits(prompt_ids, self.max_context)
        row = (self.prefix_cache.take(prompt_ids) if self.prefix_cache is not None else None) or self.spawn()
        row.logprobs = self.logprobs
        chunks = row.prefill_chunks(prompt_ids, self._admitted(sampling, len(prompt_ids) - generated),
                                    chunk or self.prefill_chunk)
        return Admission(row, chunks, len(prompt_ids))

    @lands
    def end_admit(self, admission: Admission, alone: bool = False) -> int:
        """Merge a prefilled row into the batch, target and drafter caches together or neither; `alone`: the batch
        emptied meanwhile (a finished lone sequence may still be cached), so the row's caches become the engine's.
        Returns its first token."""
        row, first = admission.row, admission.first
        if first is None:
            raise DFlashError("end_admit: the row's prefill has not finished")
        self.first_logprobs, self.last_reused = row.first_logprobs, row.last_reused
        if row is self:  # (begin_prefill's: prefilled in place)
            return first
        if alone or not self.batch:
            if self.batch and not self.shared:
                self.keep_prefix(0)  # (the finished sequence, for later prompts)
            self._take_caches(row, row.pending)
            return first
        self.shared = True  # (from here on the caches are in rows mode, even if the drafter's merge fails)
        join_caches(self.target, self.drafter, row.target, row.drafter, len(self.batch))
        self.queue.add_row(self.target)
        self.batch.append(row.batch[0])
        return first

    @lands
    def begin_prefill(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                      chunk: int | None = None) -> Admission:
        """prefill() of one prompt on an idle engine in steps, `chunk` tokens per Admission.advance(), for a caller
        that checks between chunks whether the prompt is still wanted; the row is this engine itself (its caches,
        reusing the longest cached prefix), so end_admit has nothing to merge. A prompt dropped part-way leaves its
        chunks so far as a cached prefix."""
        prompt_ids = list(prompt_ids)
        check_fits(prompt_ids, self.max_context)
        if self.shared:
            self.reset()
        return Admission(self, self._lone_chunks(prompt_ids, sampling, chunk or self.prefill_chunk), len(prompt_ids))

    def _prefill_alone(self, prompt_ids: list[int], sampling: SamplingParams | None, generated: int = 0) -> int:
        """A lone row's prefill, from the kept prefix that beats the caches' own; `sampling` becomes the engine's."""
        for first in self._lone_chunks(prompt_ids, sampling, self.prefill_chunk, generated):
            pass
        return first

    def _lone_chunks(self, prompt_ids: list[int], sampling: SamplingParams | None, chunk: int, generated: int = 0):
        if sampling is not None:
            self.set_sampling(sampling)
        self._adopt_prefix(prompt_ids)
        yield from self.prefill_chunks(prompt_ids, self._admitted(None, len(prompt_ids) - generated), chunk)

    def _admitted(self, params: SamplingParams | None, prompt_tokens: int) -> RowSampling:
        """A new row's sampling (default: the engine's settings), with a fresh noise seed unless the request has one
        (its draws are keyed by position); its output starts after `prompt_tokens`."""
        return RowSampling.admit(params or self.sampling, self.drafter is not None and self.drafter.distribution,
                                 trees=self.verify_mode == "tree", prompt_tokens=prompt_tokens)

    def prefill_chunks(self, prompt_ids: list[int], sampling: RowSampling, chunk: int):
        """Prefill `prompt_ids` as this engine's one row, sampling with `sampling`, `chunk` tokens at a time: yields
        None after every chunk but the last, then the first token."""
        self.policy.reset()
        self.crop(common_prefix(self.tokens, prompt_ids[:-1]))  # keeps >= 1 token to compute the first one from
        # (a fresh row: its prompt lookup and pause start over; its cached prefix is the crop's)
        self.batch = [BatchRow(self.tokens, sampling)]
        start, logits = len(self.tokens), None
        self.last_reused = start
        for at in range(start, len(prompt_ids), chunk):
            ids = prompt_ids[at:at + chunk]
            logits, features = self.target.forward(self.target.ids([ids]), last_only=True)
            self.tokens.extend(ids)
            if self.drafter is not None:
                self.queue.add(Pending(features, [len(ids)]))
                self.absorb_pending()
            if at + chunk < len(prompt_ids):
                self.target.settle(self.drafter)  # bound the lazy graph (and its memory) chunk by chunk
                yield None
        assert logits is not None  # (prefill runs at least the prompt's last token)
        first, logprobs = self.sample(logits[:, -1:], None, draws=self.row_draws(1, offset=0))
        self.target.settle(self.drafter, first)
        if logprobs is not None:
            self.first_logprobs = (logprobs[0][0][0], logprobs[1][0][0])
        yield self.target.to_host(first)[0][0]
