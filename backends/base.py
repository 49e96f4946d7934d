"""The protocol the core loop talks to. A backend owns arrays, models and caches; the loop owns policy.

One cycle, for block size B, with n positions in the target cache; the anchor is the last committed token, not
yet fed to the target, so it sits at position n:

    draft(anchor)  -> the drafter proposes B-1 tokens for positions n+1 .. n+B-1 from the target features of
                      every position before the anchor (new ones are appended to its context cache)
    verify()       -> the target reads [anchor, proposals] at positions n .. n+B-1 in one forward and draws its
                      own token at each of the B positions (argmax, or a sample from its processed distribution);
                      returns (proposals, target tokens) as host lists: the cycle's only device->host read
    commit(k)      -> keep the first k verified positions (k = accepted + 1): crop the target cache to n+k and
                      keep their target features as the drafter's next context

A backend without a drafter (the autoregressive baseline) proposes nothing: B = 1, verify is one target step.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from dflash.sampling import SamplingParams


class Backend(Protocol):
    name: str
    block_size: int  # 1 when there is no drafter

    def set_sampling(self, params: SamplingParams) -> None: ...

    def prefill(self, prompt_ids: Sequence[int]) -> int:
        """Feed the prompt (reusing the cached common prefix) and return the target's first token."""

    def draft(self, anchor: int) -> None: ...

    def verify(self) -> tuple[list[int], list[int]]: ...

    def commit(self, keep: int) -> None: ...

    def crop(self, length: int) -> None:
        """Forget every cached position from `length` on (target and drafter)."""

    @property
    def cached_tokens(self) -> list[int]:
        """Token ids whose target K/V is cached, in order (the prefix a later prefill may reuse)."""
