"""Sampling settings and the sample-and-match acceptance rule, in backend-neutral terms.

At every verified position the backend draws the target's token from the target's own processed distribution
(greedy = argmax). A drafted token is accepted while it equals the target's token at the same position. The
draft is a point mass, so this is exactly speculative sampling: every emitted token is a sample of target-only
decoding with the same settings. Do not sample the draft: it lowers acceptance and buys nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import DFlashError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
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
        if self.top_k < 0:
            bad("top-k", self.top_k, ">= 0 (0 = off)")
        if self.repetition_penalty <= 0:
            bad("repetition-penalty", self.repetition_penalty, "> 0 (1 = off)")
        if self.seed is not None and self.seed < 0:
            bad("seed", self.seed, ">= 0")
        return self


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
