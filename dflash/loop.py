"""The one speculative loop: prefill -> (draft -> verify -> commit)* -> stop. Every backend runs this code.

Policy lives here (what to commit, when to stop, what to count); the engine (dflash/engine.py) keeps the per-row
state over the backend's array primitives (backends/base.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from .errors import DFlashError
from .sampling import SamplingParams
from .stats import mean_acceptance_length
from .text import Detokenizer, find_stop


@dataclass
class Increment:
    """What one cycle added: token ids and the printable text they completed."""

    tokens: list[int]
    text: str


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
    cycles_without_draft: int = 0  # --verify auto: cycles that verified without a draft forward
    verify_note: str = ""

    @property
    def generation_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.acceptance_lengths)

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
        }
        if self.verify_note:
            out["verify_note"] = self.verify_note
        if trace:
            out["drafted"] = self.drafted
        return out


class _Row:
    """One sequence's output policy: EOS (kept), exact max_new_tokens, stop strings, and the text streamed so far
    (never a partial stop string)."""

    def __init__(self, gen: "Generation"):
        self.gen = gen
        self.detok = Detokenizer(gen.tokenizer)
        self.tokens: list[int] = []
        self.lengths: list[int] = []
        self.verified: list[int] = []
        self.undrafted = 0
        self.drafted: list[list[int]] = []
        self.finish: str | None = None
        self.emitted = 0
        self.hold = max((len(s) for s in gen.stop_strings), default=1) - 1  # a stop string may still be forming
        self.seconds = 0.0

    def add(self, new: list[int]) -> Increment:
        gen, detok = self.gen, self.detok
        new, finish = gen._stop_policy(new, len(self.tokens))
        kept, searched = len(self.tokens), len(detok.text)
        self.tokens.extend(new)
        detok.add(new)
        if finish is not None:
            detok.flush()
        if gen.stop_strings:
            at, end = find_stop(detok.text, gen.stop_strings, searched)
            if at != -1:
                self.tokens, finish = gen._tokens_reaching(self.tokens, kept, end), "stop"
                detok.text = detok.text[:at]
        visible = len(detok.text) if finish else max(self.emitted, len(detok.text) - self.hold)
        increment = Increment(self.tokens[kept:], detok.text[self.emitted:visible])
        self.emitted, self.finish = visible, finish
        return increment


def _cycles(backend, gens: Sequence["Generation"]) -> Iterator[list[tuple[int, Increment]]]:
    """THE speculative loop, for a batch of sequences; yields each cycle's (row, Increment) pairs and leaves the
    results on the Generations. `backend` is a dflash.engine.Engine (one row or many): rows that finish are retired
    from it, every other row drafts, verifies and commits its own accepted prefix."""
    rows = [_Row(g) for g in gens]
    if any(g.sampling != gens[0].sampling for g in gens):
        raise DFlashError("batch: every row must use the same sampling settings")
    backend.set_sampling(gens[0].sampling)
    t0 = time.perf_counter()
    anchors = backend.prefill([g.prompt_ids for g in gens])
    t1 = time.perf_counter()
    active = list(range(len(gens)))
    news = [[a] for a in anchors]
    while True:
        yield [(i, rows[i].add(new)) for i, new in zip(active, news)]
        done = [j for j, i in enumerate(active) if rows[i].finish is not None]
        now = time.perf_counter()
        for j in done:
            rows[active[j]].seconds = now - t1
        if done:
            backend.retire(done)
            active = [i for i in active if rows[i].finish is None]
        if not active:
            break

        # --- one speculative cycle, every active row at once ------------------------------------------------------
        steps = backend.step([rows[i].tokens[-1] for i in active])
        for i, step in zip(active, steps):
            rows[i].lengths.append(len(step.tokens))
            rows[i].verified.append(step.verified)
            rows[i].undrafted += not step.draft_forward
            if gens[i].trace:
                rows[i].drafted.append(step.drafted)
        news = [step.tokens for step in steps]

    for g, row in zip(gens, rows):
        g.result = GenerationResult(
            tokens=row.tokens, text=row.detok.text if g.tokenizer else "", prompt_tokens=len(g.prompt_ids),
            finish_reason=row.finish, acceptance_lengths=row.lengths, prefill_seconds=t1 - t0,
            decode_seconds=row.seconds, block_size=backend.block_size, drafted=row.drafted,
            verify_mode=getattr(backend, "verify_mode", "chain"), verified=row.verified,
            cycles_without_draft=row.undrafted, verify_note=getattr(backend, "verify_note", ""))


class Generation:
    """Iterate for `Increment`s; `.result` holds the `GenerationResult` once the iterator is exhausted."""

    def __init__(self, backend, prompt_ids: Sequence[int], *, tokenizer=None, max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), eos_token_ids: Iterable[int] = (),
                 stop_strings: Sequence[str] = (), trace: bool = False):
        if len(prompt_ids) == 0:
            raise DFlashError("prompt: empty; expected at least one token")
        if max_new_tokens < 1:
            raise DFlashError(f"--max-new-tokens: got {max_new_tokens}, expected >= 1")
        if stop_strings and tokenizer is None:
            raise DFlashError("--stop: stop strings need a tokenizer to detokenize with")
        self.backend = backend
        self.prompt_ids = list(prompt_ids)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling.validate()
        self.eos = frozenset(eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.trace = trace
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Increment]:
        for cycle in _cycles(self.backend, [self]):
            yield cycle[0][1]

    def _stop_policy(self, new: list[int], n_done: int) -> tuple[list[int], str | None]:
        """Cut a step's tokens at the first EOS (kept) and at max_new_tokens (exact)."""
        finish = None
        for i, tok in enumerate(new):
            if tok in self.eos:
                new, finish = new[: i + 1], "stop"
                break
        room = self.max_new_tokens - n_done
        if len(new) > room or (len(new) == room and finish is None):
            new, finish = new[:room], "length"
        return new, finish

    def _tokens_reaching(self, tokens: list[int], kept: int, end: int) -> list[int]:
        """The fewest tokens whose text covers a stop string ending at character `end`."""
        for k in range(kept + 1, len(tokens) + 1):
            if len(self.tokenizer.decode(tokens[:k], skip_special_tokens=True)) >= end:
                return tokens[:k]
        return tokens

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result


def generate(backend, prompt_ids: Sequence[int], **kwargs) -> GenerationResult:
    return Generation(backend, prompt_ids, **kwargs).run()


def generate_batch(backend, prompts: Sequence[Sequence[int]], **kwargs) -> list[GenerationResult]:
    """Several prompts at once through one engine (PyTorch); each row accepts its own prefix per cycle and stops on
    its own, so row i's greedy output is generate()'s for it."""
    if not prompts:
        return []
    gens = [Generation(backend, p, **kwargs) for p in prompts]
    for _ in _cycles(backend, gens):
        pass
    return [g.result for g in gens]
