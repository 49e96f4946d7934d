"""The one speculative loop: prefill -> (draft -> verify -> commit)* -> stop. Every backend runs this code.

Policy lives here (what to commit, when to stop, what to count); the engine (dflash/core/engine.py) keeps the per-row
state over the backend's Target and Drafter (dflash/core/contract.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Sequence, cast

from .engine import Engine
from .errors import DFlashError, SettingError
from .sampling import SamplingParams
from .stats import cycle_counts, mean_acceptance_length
from .text import Detokenizer, find_stop, held_back

log = logging.getLogger("dflash.batch")


@dataclass
class Increment:
    """What one cycle added: token ids and the printable text they completed; with Generation(logprobs=k), each
    token's log-probability and its top-k (id, log-probability) alternatives."""

    tokens: list[int]
    text: str
    # with logprobs: one entry per token whose text this increment releases (token_texts[i] is what that token
    # added to the output, so the entries of a whole generation join to exactly its text: a token cut by a stop
    # string keeps the part before it, a token wholly inside it has no entry); a token's entry comes out with the
    # last of its text, which a possible stop string may hold back for a cycle
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_texts: list[str] | None = None


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    acceptance_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    block_size: int
    drafted: list[list[int]] = field(default_factory=list)
    verify_mode: str = "chain"
    verified: list[int] = field(default_factory=list)  # draft tokens the target verified, per cycle
    draft_forwards: list[bool] = field(default_factory=list)  # per cycle: whether it ran a draft forward
    verify_note: str = ""
    accept_rule: str = "greedy"  # greedy, or a sampled row's rule (dflash.core.sampling.acceptance_rule)
    error: str = ""  # finish_reason "error": why this row failed (the batch's other rows went on)

    @property
    def generation_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.acceptance_lengths)

    @property
    def cycles_without_draft(self) -> int:
        """Cycles that ran no draft forward: --no-draft, or --verify auto pausing the drafter."""
        return self.draft_forwards.count(False)

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes out of the prefill; decode time covers the rest
        n = max(self.generation_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_json(self, trace: bool = False) -> dict:
        out = {
            "tokens": self.tokens,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "acceptance_lengths": self.acceptance_lengths,
            "mean_acceptance_length": self.mean_acceptance_length,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "finish_reason": self.finish_reason,
            "block_size": self.block_size,
            "verify_mode": self.verify_mode,
            "verified_tokens": sum(self.verified),
            "verified_per_cycle": self.verified,
            "cycles_without_draft": self.cycles_without_draft,
            "drafted_cycles_verifying_none": cycle_counts(self.verified, self.draft_forwards).drafted_verifying_none,
            "accept_rule": self.accept_rule,
        }
        if self.verify_note:
            out["verify_note"] = self.verify_note
        if trace:
            out["drafted"] = self.drafted
        return out


@dataclass
class _Scored:
    """A token's log-probabilities and the span of the output text it added."""

    start: int
    end: int
    logprob: float
    top: list[tuple[int, float]]


class _Row:
    """One sequence's output policy: EOS (kept), exact max_new_tokens, stop strings, and the text streamed so far
    (never a partial stop string)."""

    def __init__(self, gen: "Generation"):
        self.gen = gen
        self.detok = Detokenizer(gen.tokenizer)
        self.tokens: list[int] = []
        self.lengths: list[int] = []
        self.verified: list[int] = []
        self.draft_forwards: list[bool] = []
        self.drafted: list[list[int]] = []
        self.finish: str | None = None
        self.emitted = 0
        self.hold = max((len(s) for s in gen.stop_strings), default=1) - 1  # the longest a stop string's start runs
        self.scored: list[_Scored] = []  # (with logprobs) tokens whose entry has not been released
        self.seconds = 0.0
        self.prefill_seconds = 0.0
        self.started = 0.0  # when its prefill ended
        self.rule = "greedy"  # its acceptance rule
        self.error = ""

    def add(self, new: list[int], logprobs=None, top_logprobs=None) -> Increment:
        gen, detok = self.gen, self.detok
        new, finish = self._cut(new)
        kept, searched = len(self.tokens), len(detok.text)
        self.tokens.extend(new)
        scored = gen.logprobs is not None and logprobs is not None
        if scored:  # token by token, to know the text each one adds
            for tok, lp, top in zip(new, logprobs, top_logprobs):
                start = len(detok.text)
                detok.add([tok])
                self.scored.append(_Scored(start, len(detok.text), lp, top))
        else:
            detok.add(new)
        if finish is not None:
            detok.flush()
            if self.scored:
                self.scored[-1].end = len(detok.text)
        if gen.stop_strings:
            at, end = find_stop(detok.text, gen.stop_strings, searched)
            if at != -1:
                self.tokens, finish = self._tokens_reaching(kept, end), "stop"
                detok.text = detok.text[:at]
                self.scored = [_Scored(e.start, min(e.end, at), e.logprob, e.top) for e in self.scored
                               if e.start < at]
        if finish:
            visible = len(detok.text)
        else:  # hold back only text that may still become a stop string
            tail = detok.text[max(self.emitted, len(detok.text) - self.hold):]
            visible = max(self.emitted, len(detok.text) - held_back(tail, gen.stop_strings))
        increment = Increment(self.tokens[kept:], detok.text[self.emitted:visible])
        if gen.logprobs is not None:
            released = 0
            while released < len(self.scored) and self.scored[released].end <= visible:
                released += 1
            out, self.scored = self.scored[:released], self.scored[released:]
            increment.logprobs, increment.top_logprobs = [e.logprob for e in out], [e.top for e in out]
            increment.token_texts = [detok.text[e.start:e.end] for e in out]
        self.emitted, self.finish = visible, finish
        return increment

    def _cut(self, new: list[int]) -> tuple[list[int], str | None]:
        """Cut a step's tokens at the first EOS (kept) and at max_new_tokens (exact)."""
        finish = None
        for i, tok in enumerate(new):
            if tok in self.gen.eos:
                new, finish = new[: i + 1], "stop"
                break
        room = self.gen.max_new_tokens - len(self.tokens)
        if len(new) > room or (len(new) == room and finish is None):
            new, finish = new[:room], "length"
        return new, finish

    def _tokens_reaching(self, kept: int, end: int) -> list[int]:
        """The fewest tokens whose text covers a stop string ending at character `end` (none of the first `kept`
        dropped)."""
        for k in range(kept + 1, len(self.tokens) + 1):
            if len(self.gen.tokenizer.decode(self.tokens[:k], skip_special_tokens=True)) >= end:
                return self.tokens[:k]
        return self.tokens

    def result(self, engine: Engine) -> "GenerationResult":
        gen = self.gen
        assert self.finish is not None, "a row has a result once it finished"
        return GenerationResult(
            tokens=self.tokens, text=self.detok.text if gen.tokenizer else "", prompt_tokens=len(gen.prompt_ids),
            finish_reason=self.finish, acceptance_lengths=self.lengths, prefill_seconds=self.prefill_seconds,
            decode_seconds=self.seconds, block_size=engine.block_size, drafted=self.drafted,
            verify_mode=engine.verify_mode, verified=self.verified,
            draft_forwards=self.draft_forwards, verify_note=engine.verify_note,
            accept_rule=self.rule, error=self.error)


class Batch:
    """THE speculative loop as a running batch over one engine (dflash.core.engine.Engine, one row or many).

    Generations join between cycles (`join`: the prompt is prefilled through Engine.admit with the generation's own
    sampling settings) and leave as soon as they finish or are cancelled (Engine.retire); `step` is one cycle for
    every live row: each drafts, verifies and commits its own accepted prefix. A finished generation's `.result` is
    set when it leaves. generate(), generate_batch() and the server's engine thread all drive this object.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.rows: list[_Row] = []  # live rows, in the engine's row order

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
            first = engine.prefill([gen.prompt_ids])[0]
        row = _Row(gen)
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

    def _record(self, row: _Row, step) -> Increment:
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

    def _rebuild(self, row: _Row) -> None:
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
