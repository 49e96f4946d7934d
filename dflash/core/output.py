"""One sequence's output: what a cycle's tokens add to it (EOS kept, exactly max_new_tokens, stop strings cut), the
text streamed so far (never a partial stop string: only a tail that may still become one is held back), each token's
log-probabilities released with the last of the text it added, and the result once it finishes. The loop
(dflash/core/loop.py) keeps one OutputRow per live row. Also here, shared by every backend and CLI: incremental
detokenization and the stop-string search, and the acceptance statistics (tau, the histogram, per-position
acceptance, cycle counts) that results and reports give."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine


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
class Scored:
    """A token's log-probabilities and the span of the output text it added."""

    start: int
    end: int
    logprob: float
    top: list[tuple[int, float]]


class OutputRow:
    """One sequence's output policy: EOS (kept), exact max_new_tokens, stop strings, and the text streamed so far
    (never a partial stop string)."""

    def __init__(self, gen):  # (a dflash.core.loop.Generation: its settings, and where its result goes)
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
        self.scored: list[Scored] = []  # (with logprobs) tokens whose entry has not been released
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
                self.scored.append(Scored(start, len(detok.text), lp, top))
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
                self.scored = [Scored(e.start, min(e.end, at), e.logprob, e.top) for e in self.scored
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


# ---- text: incremental detokenization, stop strings --------------------------------------------------------------
class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Decodes only a short window (from the last emitted boundary), so each step costs O(new tokens), and the
    window's left context keeps tokenizers that merge spaces across tokens correct.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # ids before this index are already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Everything not yet emitted (also an incomplete trailing character)."""
        if self.tokenizer is None or self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        delta = self._decode(self.ids[self._prefix:])[len(before):]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stop_strings: list[str], start: int) -> tuple[int, int]:
    """(index, end) of the earliest stop string that ends after `start` (only new matches), or (-1, -1)."""
    best = (-1, -1)
    for s in stop_strings:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best[0] == -1 or i < best[0]):
            best = (i, i + len(s))
    return best


def held_back(text: str, strings: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `strings`: the characters a stream
    holds back because they may still become one of them (text that can no longer match goes out at once)."""
    if not text:
        return 0
    best, last = 0, text[-1]
    for s in strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s[n - 1] == last and text.endswith(s[:n]):
                best = n
                break
    return best


# ---- acceptance statistics ---------------------------------------------------------------------------------------
def mean_acceptance_length(lengths: list[int]) -> float:
    """tau: tokens committed per verification cycle (accepted draft tokens + the target's bonus token)."""
    return sum(lengths) / len(lengths) if lengths else 0.0


def acceptance_histogram(lengths: list[int], block_size: int) -> list[int]:
    """counts[k-1] = cycles that committed k tokens, k = 1 .. block_size."""
    c = Counter(lengths)
    return [c.get(k, 0) for k in range(1, block_size + 1)]


def per_position_acceptance(lengths: list[int], block_size: int) -> list[float]:
    """rate[k-1] = fraction of cycles whose k-th drafted token was accepted, k = 1 .. block_size-1."""
    if not lengths:
        return [0.0] * (block_size - 1)
    return [sum(1 for n in lengths if n - 1 >= k) / len(lengths) for k in range(1, block_size)]


def summary_line(tau: float, tokens_per_second: float, n_tokens: int, prefill_seconds: float) -> str:
    return (f"tau {tau:.2f} | {tokens_per_second:.1f} tok/s | {n_tokens} tokens | "
            f"prefill {prefill_seconds * 1000:.0f} ms")


@dataclass(frozen=True)
class CycleCounts:
    """What the verify cycles did. A cycle of --verify auto may run no draft forward (the drafter paused, or
    --no-draft), or run one and verify none of it (no proposal was predicted to pay for its verify cost): both are
    plain target steps."""

    cycles: int
    drafted: int  # cycles that ran a draft forward
    drafted_verifying_none: int  # ... and verified none of its proposals
    verified_when_drafted: list[int]  # draft tokens verified, per cycle that ran a draft forward

    @property
    def without_draft(self) -> int:
        return self.cycles - self.drafted


def cycle_counts(verified: list[int], draft_forwards: list[bool]) -> CycleCounts:
    drafted = [v for v, forward in zip(verified, draft_forwards) if forward]
    return CycleCounts(len(verified), len(drafted), drafted.count(0), drafted)
