"""Training a DFlash drafter, in composable parts read top to bottom:

  config.py      TrainConfig (the flags of `python -m dflash.train`) and TrainResult
  objective.py   anchors, blocks, the position-weighted loss (CE, optionally blended with the target's distribution)
  attention.py   the packed forward's attention rule (one predicate, as inference runs it) as Flex / dense / split
  data.py        samples, held-out prompts, the deterministic batch and anchor order
  model.py       the drafter's shape and initialisation, DDP / FSDP2 wrapping
  run.py         what a run needs before its first step (target, data, drafter, optimiser), built once
  checkpoint.py  atomic checkpoints, resume, export
  evaluate.py    tau with the real speculative loop
  log.py         console lines, progress bar, train_log.jsonl
  loop.py        train(): prepare, train_step until done, export
Hub ids, the output folder check, curves.png and the hub upload belong to the command (dflash/train.py).
"""

from .attention import (LayerRule, SplitMask, attention_fn, build_masks, dense_mask, draft_attends, flex_mask,
                        layer_rules, mask_rule, split_attention)
from .config import TrainConfig, TrainResult
from .loop import train, train_step
from .model import first_free_embedding_row, init_drafter, new_draft_spec
from .objective import (DEFAULT_GAMMA, block_loss_sum, build_blocks, chunked_block_loss, cosine_lr, default_gamma,
                        dflash_loss, packed_forward, sample_anchors, target_features)

__all__ = ["LayerRule", "SplitMask", "attention_fn", "build_masks", "dense_mask", "draft_attends", "flex_mask",
           "layer_rules", "mask_rule", "split_attention", "TrainConfig", "TrainResult", "train", "train_step",
           "first_free_embedding_row", "init_drafter", "new_draft_spec", "DEFAULT_GAMMA", "block_loss_sum",
           "build_blocks", "chunked_block_loss", "cosine_lr", "default_gamma", "dflash_loss", "packed_forward",
           "sample_anchors", "target_features"]
