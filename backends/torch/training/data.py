"""Training data: samples in compact storage, held-out prompts, and the deterministic order of a run.

  step s -> (epoch, global batch) : a fixed slice of a seeded per-epoch permutation (last partial batch dropped)
  sample i in epoch e -> anchors  : a generator seeded by (seed, e, i), whichever rank, micro-batch or restart
So the batches and anchors of a run depend on nothing but the seed: any world size, any resume.
"""

from __future__ import annotations

import functools
from array import array

import torch

from dflash.core.errors import DFlashError

from .objective import sample_anchors


def load_samples(cfg, tokenizer, cache=None) -> list[dict]:
    """{"input_ids", "loss_mask"} rows from cfg.samples, the feature cache or cfg.data, truncated to max_length and
    stored as arrays (4 + 1 bytes per token instead of Python lists: 800K x 3K-token samples fit in memory)."""
    if cfg.samples is not None:
        samples = [dict(x) for x in cfg.samples]
    elif cache is not None:
        samples = cache.samples()
    elif cfg.data:
        from dflash.core.training.datasets import load_samples as tokenise

        samples = tokenise(cfg.data, tokenizer, max_length=cfg.max_length, enable_thinking=cfg.enable_thinking,
                           rows=row_range(cfg.data_rows) if cfg.data_rows else None)
    else:
        raise DFlashError("--data: training data is required (JSONL / datasets dir, or --features DIR)")
    return [dict(x, input_ids=array("i", x["input_ids"][:cfg.max_length]),
                 loss_mask=array("b", x["loss_mask"][:cfg.max_length])) for x in samples]


def row_range(rows: str | None) -> tuple[int, int | None]:
    """--data-rows "START:STOP" (either side may be empty) as (start, stop)."""
    if not rows:
        return 0, None
    try:
        start, stop = rows.split(":")
        return int(start or 0), int(stop) if stop else None
    except ValueError:
        raise DFlashError(f"--data-rows: got {rows!r}, expected START:STOP row numbers, e.g. 0:20000") from None


def split_eval_prompts(cfg, samples: list[dict], tokenizer) -> tuple[list[dict], list[list[int]]]:
    """(training samples, held-out prompts): --eval-holdout takes the last N samples out of training."""
    prompts = [list(p) for p in cfg.eval_prompts] if cfg.eval_prompts else []
    if cfg.eval_holdout:
        from dflash.core.training.datasets import prompt_of

        held, samples = samples[-cfg.eval_holdout:], samples[:-cfg.eval_holdout]
        prompts += [prompt_of(x) for x in held]
    if cfg.eval_data:
        from dflash.core.training.datasets import load_eval_prompts

        prompts += load_eval_prompts(cfg.eval_data, tokenizer, cfg.enable_thinking)
    return samples, [p for p in prompts if p][:cfg.eval_max_prompts]


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # one stream per (seed, epoch, sample): reproducible on any rank, after any restart, fresh every epoch
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_000_007 + index)


@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def step_indices(step: int, n: int, global_batch: int, seed: int) -> tuple[int, list[int]]:
    """(epoch, sample indices) of the global batch of `step`; the last partial batch of an epoch is dropped."""
    per_epoch = n // global_batch
    epoch, i = divmod(step, per_epoch)
    return epoch, epoch_order(n, seed, epoch)[i * global_batch:(i + 1) * global_batch]


def sample_anchors_of(sample: dict, num_anchors: int, seed: int, epoch: int, index: int):
    """(anchors (N,), valid (N,)) of one sample in one epoch."""
    mask = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)[None]
    a, v = sample_anchors(mask, num_anchors, anchor_generator(seed, epoch, index))
    return a[0], v[0]


def sample_weight(sample: dict, anchors, valid, block_size: int, gamma: float, vocab=None) -> float:
    """sum of loss weights of one sample's blocks (for the global normaliser), without building the blocks.
    `vocab`: a draft vocabulary's t2d (CPU), whose off-vocabulary labels carry no loss (objective.draft_labels)."""
    mask = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)
    s = mask.shape[0]
    k = torch.arange(1, block_size)
    pos = anchors[valid][:, None] + k
    ok = (pos < s) & mask[pos.clamp(max=s - 1)]
    if vocab is not None:
        ok &= vocab[torch.as_tensor(sample["input_ids"], dtype=torch.long)[pos.clamp(max=s - 1)]]
    return float((torch.exp(-(k.float() - 1) / gamma) * ok).sum())


def collate(samples: list[dict], anchors: list, device) -> tuple:
    """Right-pad a micro-batch; anchors are trimmed to the most valid ones any sample has (pads are masked)."""
    s = max(len(x["input_ids"]) for x in samples)
    ids = torch.zeros(len(samples), s, dtype=torch.long)
    mask = torch.zeros(len(samples), s, dtype=torch.bool)
    for i, x in enumerate(samples):
        ids[i, :len(x["input_ids"])] = torch.as_tensor(x["input_ids"], dtype=torch.long)
        mask[i, :len(x["loss_mask"])] = torch.as_tensor(x["loss_mask"], dtype=torch.bool)
    n = max(1, max(int(v.sum()) for _, v in anchors))
    a = torch.stack([a[:n] for a, _ in anchors])
    v = torch.stack([v[:n] for _, v in anchors])
    return ids.to(device), mask.to(device), a.to(device), v.to(device)
