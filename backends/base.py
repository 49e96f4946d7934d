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


class BatchBackend(Protocol):
    """The same cycle for a batch of sequences (dflash.loop.generate_batch). Every list holds one entry per active
    row, in order; `retire` drops finished rows (by index into the active rows) so they cost nothing more."""

    block_size: int

    def set_sampling(self, params: SamplingParams) -> None: ...

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[int]: ...

    def draft(self, anchors: Sequence[int]) -> None: ...

    def verify(self) -> tuple[list[list[int]], list[list[int]]]: ...

    def commit(self, keeps: Sequence[int]) -> None: ...

    def retire(self, rows: Sequence[int]) -> None: ...


def check_fits(prompt_ids: Sequence[int], max_context: int | None) -> None:
    """One line when a prompt leaves no room in the target's context for a new token."""
    from dflash.errors import DFlashError

    if max_context and len(prompt_ids) >= max_context:
        raise DFlashError(f"prompt: {len(prompt_ids)} tokens do not fit the target's context "
                          f"(max_position_embeddings {max_context})")


def crop_to_cached_prefix(backend, prompt_ids: Sequence[int], max_context: int | None) -> int:
    """Shared start of every backend's prefill: check that the prompt fits the target's context, crop the caches to
    the longest cached prefix of the prompt (keeping at least one token, whose logits give the first new token) and
    return the index prefill must start from (lower than the prefix when a window forced a fresh start)."""
    check_fits(prompt_ids, max_context)
    reuse = 0
    for a, b in zip(backend.cached_tokens, prompt_ids[:-1]):
        if a != b:
            break
        reuse += 1
    backend.crop(reuse)
    return len(backend.cached_tokens)
