"""The one speculative loop: prefill -> (draft -> verify -> commit)* -> stop. Every backend runs this code.

Policy lives here (what to commit, when to stop, what to count); the engine (dflash/core/engine.py) keeps the per-row
state over the backend's Target and Drafter (dflash/core/contract.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from typing import Iterable, Iterator, Sequence, cast

from .engine import Engine
from .errors import DFlashError, SettingError
from .output import GenerationResult as GenerationResult  # (re-exported: the loop's public types)
from .output import Increment as Increment
from .output import OutputRow
from .progress import Heartbeat
from .sampling import SamplingParams

log = logging.getLogger("dflash.batch")
LONG_PROMPT = 1024  # prompts of this many tokens prefill under a heartbeat (dflash/core/progress.py)


class Batch:
    """THE speculative loop as a running batch over one engine (dflash.core.engine.Engine, one row or many).

    Generations join between cycles (`join`: the prompt is prefilled through Engine.admit with the generation's own
    sampling settings) and leave as soon as they finish or are cancelled (Engine.retire); `step` is one cycle for
    every live row: each drafts, verifies and commits its own accepted prefix. A finished generation's `.result` is
    set when it leaves. generate(), generate_batch() and the server's engine thread all drive this object.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.rows: list[OutputRow] = []  # live rows, in the engine's row order

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def generations(self) -> list["Generation"]:
        return [r.gen for r in self.rows]

    def begin(self, gen: "Generation", chunk: int, alone: bool = False):
        """Start `gen`'s prefill beside the running rows, `chunk` prompt tokens per `.advance()` of the returned
        admission, for a caller that interleaves it with cycles (a joining prompt then never stalls the running
        streams for its whole prefill); join(gen, admission) adds the row once advance() says the prompt is in.
        `alone`: no row runs and no other prompt is being prefilled, so the prompt goes into the engine's own caches
        (reusing the previous sequence's prefix, as join() without an admission does)."""
        self._want_logprobs(extra=gen)
        if alone:
            assert not self.rows, "a prompt is prefilled alone only into an idle engine"
            return self.engine.begin_prefill(gen.prompt_ids, gen.sampling, chunk)
        return self.engine.begin_admit(gen.prompt_ids, gen.sampling, chunk)

    def join(self, gen: "Generation", admission=None) -> Increment:
        """Prefill `gen` (or take its finished admission from begin()) and add it to the batch; returns its first
        Increment (it may already be finished)."""
        engine = self.engine
        self._want_logprobs(extra=gen)
        t0 = admission.started if admission is not None else time.perf_counter()
        if admission is not None:
            first = engine.end_admit(admission, alone=not self.rows)
        elif self.rows:
            first = engine.admit(gen.prompt_ids, gen.sampling)
        else:  # a lone sequence: the engine reuses the longest cached prefix of the previous one
            engine.set_sampling(gen.sampling)
            n = len(gen.prompt_ids)  # (a long prompt on a CPU prefills for tens of seconds: say so past a few)
            with Heartbeat(f"prefilling the prompt's {n} tokens") if n >= LONG_PROMPT else contextlib.nullcontext():
                first = engine.prefill([gen.prompt_ids])[0]
        row = OutputRow(gen)
        row.rule = engine.accept_rules[-1] if engine.accept_rules else "greedy"
        row.started = time.perf_counter()
        row.prefill_seconds = row.started - t0
        self.rows.append(row)
        lp = engine.first_logprobs if gen.logprobs is not None else None
        inc = row.add([first], *(([lp[0]], [lp[1]]) if lp else ()))
        self._leave()
        return inc

    def step(self) -> list[tuple["Generation", Increment]]:
        """One speculative cycle for every live row; finished rows leave the batch at once."""
        if not self.rows:
            return []
        try:
            steps = self.engine.step([r.tokens[-1] for r in self.rows])
        except Exception as e:
            if len(self.rows) == 1:
                raise  # nothing to isolate: the caller fails this generation
            return self._isolate(e)
        out = [(row.gen, self._record(row, step)) for row, step in zip(self.rows, steps)]
        self._leave()
        return out

    def _record(self, row: OutputRow, step) -> Increment:
        row.lengths.append(len(step.tokens))
        row.verified.append(step.verified)
        row.draft_forwards.append(step.draft_forward)
        if row.gen.trace:
            row.drafted.append(step.drafted)
        return row.add(step.tokens, step.logprobs, step.top_logprobs)

    def cancel(self, gen: "Generation") -> None:
        """Drop a live generation now (finish_reason "cancelled"); its row is freed before the next cycle."""
        for row in self.rows:
            if row.gen is gen and row.finish is None:
                row.finish = "cancelled"
        self._leave()

    def _isolate(self, error: Exception) -> list[tuple["Generation", Increment]]:
        """A batched step raised. Its caches may hold half a cycle (drafted, forwarded, not committed), and undoing
        that in place would need every backend to rewind a failed forward, so none of it is trusted: each row replays
        the cycle alone, rebuilt from its committed tokens (prompt + tokens[:-1] cached, tokens[-1] the anchor:
        exactly the state after a commit), and its replay is its cycle. A row whose replay raises fails alone (finish
        "error", its own message). When every row replays clean, the failure was the batch's, not a request's: it is
        logged once (the traceback at debug level) and no row fails. The rows left are rebuilt into a fresh batch and
        go on; each has committed a cycle, so a batch that fails every cycle still finishes its rows. Greedy rows
        continue as they would have, and so do seeded sampled rows (their noise is keyed by position, not by the
        draws before)."""
        engine, failed, out = self.engine, {}, []
        for row in self.rows:
            engine.reset()
            try:
                self._rebuild(row)
                step = engine.step([row.tokens[-1]])[0]
            except Exception as e:  # noqa: BLE001  (the row's own failure, reported on it)
                failed[id(row)] = f"{type(e).__name__}: {e}"
                continue
            out.append((row.gen, self._record(row, step)))
        engine.reset()
        if not failed:
            log.warning("batch step failed with every one of its %d rows replaying clean alone (a batch fault, not "
                         "a request's): %s: %s; the rows go on in a rebuilt batch", len(self.rows),
                         type(error).__name__, error)
            log.debug("the batch fault", exc_info=error)
        now = time.perf_counter()
        for row in self.rows:
            if id(row) in failed:
                row.finish, row.error = "error", failed[id(row)]
            if row.finish is not None:  # (failed, or finished by its replay)
                row.seconds = now - row.started
                row.gen.result = row.result(engine)
        self.rows = [r for r in self.rows if r.finish is None]
        for row in self.rows:
            self._rebuild(row)
        self._want_logprobs()
        return out

    def _rebuild(self, row: OutputRow) -> None:
        self.engine.admit(row.gen.prompt_ids + row.tokens[:-1], row.gen.sampling, generated=len(row.tokens) - 1)

    def _leave(self) -> None:
        done = [j for j, r in enumerate(self.rows) if r.finish is not None]
        if not done:
            return
        now = time.perf_counter()
        for j in done:
            row = self.rows[j]
            row.seconds = now - row.started
            row.gen.result = row.result(self.engine)
        self.engine.retire(done)
        self.rows = [r for r in self.rows if r.finish is None]
        self._want_logprobs()

    def _want_logprobs(self, extra: "Generation | None" = None) -> None:
        wants = [g.logprobs for g in self.generations + ([extra] if extra else []) if g.logprobs is not None]
        self.engine.logprobs = max(wants) if wants else None


def _cycles(engine: Engine, gens: Sequence["Generation"]) -> Iterator[list[tuple[int, Increment]]]:
    """A fixed set of generations through one Batch; yields each cycle's (index, Increment) pairs (the first: every
    prefill's token) and leaves the results on the Generations."""
    batch = Batch(engine)
    yield [(i, batch.join(g)) for i, g in enumerate(gens)]
    index = {id(g): i for i, g in enumerate(gens)}
    while batch:
        yield [(index[id(g)], inc) for g, inc in batch.step()]


class Generation:
    """Iterate for `Increment`s; `.result` holds the `GenerationResult` once the iterator is exhausted."""

    def __init__(self, engine: Engine, prompt_ids: Sequence[int], *, tokenizer=None, max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), eos_token_ids: Iterable[int] = (),
                 stop_strings: Sequence[str] = (), trace: bool = False, logprobs: int | None = None):
        if len(prompt_ids) == 0:
            raise DFlashError("prompt: empty; expected at least one token")
        if max_new_tokens < 1:
            raise SettingError("max_new_tokens", f"got {max_new_tokens}, expected >= 1")
        if stop_strings and tokenizer is None:
            raise DFlashError("--stop: stop strings need a tokenizer to detokenize with")
        self.engine = engine
        self.prompt_ids = list(prompt_ids)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling.validate()
        self.eos = frozenset(eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.trace = trace
        self.logprobs = logprobs  # None: off; k: each token's log-probability and its top k alternatives
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Increment]:
        for cycle in _cycles(self.engine, [self]):
            yield cycle[0][1]

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None, "the iterator ends with the result set"
        return self.result


def generate(engine: Engine, prompt_ids: Sequence[int], **kwargs) -> GenerationResult:
    return Generation(engine, prompt_ids, **kwargs).run()


def generate_batch(engine: Engine, prompts: Sequence[Sequence[int]], *, on_cycle=None, **kwargs) -> list[GenerationResult]:
    """Several prompts at once through one engine (any backend whose target batches); each row accepts its own prefix per cycle and stops on
    its own, so row i's greedy output is generate()'s for it. on_cycle(tokens, finished), if given, is called after
    every cycle with the tokens it committed over all rows and the (index, result) of each row that finished in it,
    so a caller can report progress and keep answers as they finish."""
    if not prompts:
        return []
    sampling = kwargs.pop("sampling", SamplingParams())
    # every row draws from its own generator: seeded rows get seed + i, so they draw independently (row 0's draw
    # is generate()'s with the same seed)
    per_row = [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
               for i in range(len(prompts))]
    gens = [Generation(engine, p, sampling=s, **kwargs) for p, s in zip(prompts, per_row)]
    reported: set[int] = set()
    for increments in _cycles(engine, gens):
        if on_cycle is not None:
            finished = [(i, g.result) for i, g in enumerate(gens) if g.result is not None and i not in reported]
            reported.update(i for i, _ in finished)
            on_cycle(sum(len(inc.tokens) for _, inc in increments), finished)
    return cast(list[GenerationResult], [g.result for g in gens])  # _cycles ran every one to its end
