"""Give an existing drafter a draft vocabulary (dflash.core.draft_vocab) ranked from the target's own answers: the
drafter's layers unchanged, its head the target's LM-head rows of the chosen tokens (`python -m dflash.data
draft-vocab`)."""

from __future__ import annotations

import os
from pathlib import Path

from dflash.core.draft_vocab import count_answer_tokens, select_tokens
from dflash.core.errors import DFlashError

from .drafter import load_drafter, save_drafter, with_draft_vocab
from .target import load_target, target_info


def write_draft_vocab(target_dir: str | os.PathLike, draft_dir: str | os.PathLike, samples: list[dict],
                      size: int, out_dir: str | os.PathLike, *, trust_remote_code: bool = False) -> dict:
    """Write draft_dir's drafter with a draft vocabulary of the `size` tokens most frequent among the supervised
    tokens of `samples` to out_dir (its layers in their stored dtypes, the head in the target head's dtype).
    Returns what was chosen: size, tokens counted, and the share of them the vocabulary covers."""
    drafter = load_drafter(draft_dir, dtype=None)  # as stored: the layers are written back unchanged
    if drafter.spec.has_draft_vocab:
        raise DFlashError(f"--draft: {draft_dir} has a draft vocabulary of {drafter.spec.draft_vocab_size} tokens "
                          "already; start from a drafter without one")
    model = load_target(target_dir, "auto", "cpu", trust_remote_code)
    drafter.spec.validate_against(target_info(model), source=str(draft_dir))
    counts = count_answer_tokens(samples)
    ids = select_tokens(counts, size, drafter.spec.vocab_size, source="--size")
    save_drafter(with_draft_vocab(drafter, ids, model.get_output_embeddings().weight), Path(out_dir))
    total = sum(counts.values())
    covered = sum(counts[t] for t in ids)
    return {"draft_vocab_size": size, "answer_tokens": total, "distinct_tokens": len(counts),
            "coverage": covered / total if total else 0.0}
