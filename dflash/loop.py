"""The one speculative loop: prefill -> (draft -> verify -> commit)* -> stop. Every backend runs this code.

Policy lives here (what to commit, when to stop, what to count); arrays and caches live in the backend
(see backends/base.py for the protocol).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from .errors import DFlashError
from .sampling import SamplingParams, accepted_length
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
        }
        if trace:
            out["drafted"] = self.drafted
        return out


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
        backend, detok = self.backend, Detokenizer(self.tokenizer)
        tokens: list[int] = []
        lengths: list[int] = []
        drafted_log: list[list[int]] = []

        backend.set_sampling(self.sampling)
        t0 = time.perf_counter()
        anchor = backend.prefill(self.prompt_ids)
        t1 = time.perf_counter()
        new = [anchor]
        hold = max((len(s) for s in self.stop_strings), default=1) - 1  # a stop string may still be forming
        emitted = 0
        while True:
            new, finish = self._stop_policy(new, len(tokens))
            kept, searched = len(tokens), len(detok.text)
            tokens.extend(new)
            detok.add(new)
            if finish is not None:
                detok.flush()
            if self.stop_strings:
                at, end = find_stop(detok.text, self.stop_strings, searched)
                if at != -1:
                    tokens, finish = self._tokens_reaching(tokens, kept, end), "stop"
                    detok.text = detok.text[:at]
            visible = len(detok.text) if finish else max(emitted, len(detok.text) - hold)
            yield Increment(tokens[kept:], detok.text[emitted:visible])
            emitted = visible
            if finish is not None:
                break

            # --- one speculative cycle ------------------------------------------------------------------------
            backend.draft(tokens[-1])
            drafted, target = backend.verify()
            accepted = accepted_length(drafted, target)
            backend.commit(accepted + 1)
            lengths.append(accepted + 1)
            if self.trace:
                drafted_log.append(drafted)
            new = target[: accepted + 1]

        t2 = time.perf_counter()
        text = detok.text if self.tokenizer else ""
        self.result = GenerationResult(
            tokens=tokens, text=text, prompt_tokens=len(self.prompt_ids), finish_reason=finish,
            acceptance_lengths=lengths, prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
            block_size=backend.block_size, drafted=drafted_log)

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
