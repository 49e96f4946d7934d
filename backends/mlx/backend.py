"""MLX backend: an mlx-lm target + a DFlash drafter as primitives of the one engine (dflash/core/engine.py)."""

from __future__ import annotations

import mlx.core as mx

from dflash.core.engine import Engine
from dflash.core.spec import drafter_block_size

from .draft_runner import MLXDraft
from .drafter import DFlashDrafter
from .target import embedding, lm_head
from .target_runner import MLXTarget


def mlx_engine(model, config: dict, drafter: DFlashDrafter | None = None, block_size: int | None = None,
               draft_window: int | None = None, prefill_chunk: int = 2048, validated: bool = False) -> Engine:
    """The engine over an mlx-lm target (+ a drafter)."""
    target = MLXTarget(model, config, drafter.spec.target_layer_ids if drafter is not None else None)
    draft = None
    if drafter is not None:
        block_size = drafter_block_size(drafter, target.info, block_size, validated)
        embed = embedding(model)
        dtype = embed(mx.array([[0]])).dtype  # the drafter computes in the dtype the embeddings come out in
        draft = MLXDraft(drafter, embed, lm_head(model), dtype, window=draft_window,
                         logit_scaling=drafter.spec.logit_scaling(target.info))
    return Engine(target, draft, block_size=block_size or 1, prefill_chunk=prefill_chunk, name="mlx")
