"""Sampling settings and the sample-and-match acceptance rule, in backend-neutral terms.

At every verified position the backend draws the target's token from the target's own processed distribution
(greedy = argmax). A drafted token is accepted while it equals the target's token at the same position. The
draft is a point mass, so this is exactly speculative sampling: every emitted token is a sample of target-only
decoding with the same settings. Under this rule, do not sample the draft: it lowers acceptance and buys nothing.

A drafter with a proper draft distribution (DFlash2: its selector's q_t = softmax(S_t(a, .) / T) over the top-k
candidates) also allows exact rejection sampling ("rejection"): the draft samples x_t ~ q_t, the target accepts it
with probability min(1, p(x_t) / q(x_t)) and, at the first rejection, draws from the residual max(0, p - q)
normalised; after a fully accepted block the bonus token is drawn from p. The draft and the acceptance / residual
draws use independent noise streams (a shared one biases the output). Which rule a run uses is `acceptance_rule`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import DFlashError


# vLLM's conventions: a temperature below this is greedy (dividing logits by 1e-38 overflows to inf and the softmax to
# nan); top_k -1 is "off" like 0. The repetition penalty divides (or multiplies) logits by itself, so it is kept
# within a range that cannot overflow float16/32 logits.
SAMPLING_EPS = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    accept: str = "auto"  # the acceptance rule when sampling: "auto", "match" or "rejection" (acceptance_rule)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Refuse what no sampler can use; returns the settings normalised (a temperature below SAMPLING_EPS is
        greedy: 0; top_k -1 is off: 0)."""
        def bad(flag: str, value, expected: str):
            raise DFlashError(f"--{flag}: got {value!r}, expected {expected}")

        for flag, value in (("temperature", self.temperature), ("top-p", self.top_p), ("min-p", self.min_p),
                            ("repetition-penalty", self.repetition_penalty)):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(flag, value, "a finite number")
        if self.temperature < 0:
            bad("temperature", self.temperature, ">= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            bad("top-p", self.top_p, "a value in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min-p", self.min_p, "a value in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top-k", self.top_k, ">= 0 (0 or -1 = off)")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            bad("repetition-penalty", self.repetition_penalty, f"a value in [{low:g}, {high:g}] (1 = off)")
        if self.seed is not None and self.seed < 0:
            bad("seed", self.seed, ">= 0")
        if self.accept not in ACCEPT_RULES:
            bad("accept", self.accept, " or ".join(repr(r) for r in ACCEPT_RULES))
        if self.temperature < SAMPLING_EPS and self.temperature != 0.0 or self.top_k == -1:
            return replace(self, temperature=0.0 if self.temperature < SAMPLING_EPS else self.temperature,
                           top_k=max(self.top_k, 0))
        return self


ACCEPT_RULES = ("auto", "match", "rejection")
# The rule "auto" picks for drafters with a draft distribution, from the acceptance measured at temperatures 0.8
# and 1.0 (docs/dflash2.md).
DISTRIBUTION_DEFAULT = "rejection"


def acceptance_rule(params: SamplingParams, has_distribution: bool) -> str:
    """"match" (sample-and-match against the draft's point mass) or "rejection" (exact rejection sampling against
    the drafter's own distribution). Greedy decoding always matches."""
    if params.greedy:
        return "match"
    if params.accept == "rejection" and not has_distribution:
        raise DFlashError("--accept: 'rejection' needs a drafter with a draft distribution (a DFlash2 drafter); "
                          "use 'match'")
    if params.accept == "auto":
        return DISTRIBUTION_DEFAULT if has_distribution else "match"
    return params.accept


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accepted_length(drafted: list[int], target: list[int]) -> int:
    """Number of leading drafted tokens equal to the target's tokens at the same positions.

    drafted[i] is the proposal for the position the target fills with target[i]; len(target) == len(drafted) + 1,
    the extra target token being the bonus committed after the accepted prefix.
    """
    return common_prefix(drafted, target)
