"""A drafter's draft vocabulary (FR-Spec, arXiv 2502.14856; EAGLE-3's d2t / t2d): the drafter scores only the
target's most frequent tokens, which shrinks its LM head; the target still verifies over its whole vocabulary.

Stored the way speculators writes it and vLLM reads it: config.json `draft_vocab_size` D (top level) and, in
model.safetensors,
  lm_head.weight  (D, hidden)  the drafter's own head: the target's LM-head rows of the chosen tokens
  d2t             (D,) int64   offsets: target id of draft id i = i + d2t[i] (the chosen ids, ascending)
  t2d             (V,) bool    which target ids are in the draft vocabulary
A drafter without `draft_vocab_size` (or with D equal to the target's vocabulary) has none of the three.

The tokens are ranked by how often they occur in the target's own answers (the supervised tokens of the training
data), ties broken by the smaller id; a vocabulary larger than the tokens seen is filled with the smallest unseen
ids (speculators' rule, so the same counts give the same map there and here).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

from .errors import DFlashError


def count_answer_tokens(samples: Iterable[dict]) -> Counter:
    """How often each token occurs among the supervised (assistant) tokens of tokenised samples
    ({"input_ids", "loss_mask"}, as dflash.core.training.datasets.load_samples returns them)."""
    counts: Counter = Counter()
    for sample in samples:
        counts.update(t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m)
    return counts


def select_tokens(counts: Mapping[int, int], size: int, vocab_size: int, source: str = "--draft-vocab") -> list[int]:
    """The `size` most frequent target ids (ties: the smaller id first), padded with the smallest unseen ids, in
    ascending order (draft id i is the i-th smallest chosen target id)."""
    if not 1 <= size <= vocab_size:
        raise DFlashError(f"{source}: got {size}, expected 1..{vocab_size} (the target's vocabulary)")
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise DFlashError(f"{source}: token id {bad[0]} in the data is outside the target's vocabulary "
                          f"(0..{vocab_size - 1}); was the data tokenised for another model?")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    filler = (t for t in range(vocab_size) if t not in chosen)
    ranked += [next(filler) for _ in range(size - len(ranked))]
    return sorted(ranked)


def vocab_maps(token_ids: list[int], vocab_size: int) -> tuple[list[int], list[bool]]:
    """(d2t, t2d) of the chosen target ids (ascending): d2t[i] = token_ids[i] - i, t2d[t] = t is chosen."""
    t2d = [False] * vocab_size
    for t in token_ids:
        t2d[t] = True
    return [t - i for i, t in enumerate(token_ids)], t2d


def check_maps(d2t: list[int], t2d: list[bool], vocab_size: int, source: str) -> list[int]:
    """The target ids of a loaded d2t / t2d pair, after checking that they describe one vocabulary: every
    i + d2t[i] a distinct id of the target's vocabulary, and t2d true exactly there."""
    ids = [i + int(o) for i, o in enumerate(d2t)]
    if any(not 0 <= t < vocab_size for t in ids):
        bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise DFlashError(f"{source}: d2t[{bad}] maps draft id {bad} to {ids[bad]}, outside the target's "
                          f"vocabulary (0..{vocab_size - 1}); d2t holds offsets (target id = draft id + d2t)")
    if len(set(ids)) != len(ids):
        raise DFlashError(f"{source}: d2t maps two draft ids to the same target id")
    if sum(bool(x) for x in t2d) != len(ids) or not all(t2d[t] for t in ids):
        raise DFlashError(f"{source}: t2d does not mark exactly the {len(ids)} target ids d2t maps to")
    return ids
