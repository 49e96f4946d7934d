"""PyTorch backend: a transformers target + a DFlash drafter as primitives of the one engine (dflash/core/engine.py)."""

from __future__ import annotations

from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.spec import drafter_block_size

from .draft_runner import TorchDraft
from .drafter import DFlashDrafter
from .target_runner import TorchTarget


def torch_engine(model, drafter: DFlashDrafter | None = None, block_size: int | None = None,
                 draft_window: int | None = None, prefill_chunk: int = 2048, cache_len: int | None = None,
                 compile: bool = False, compile_draft: bool | None = None, validated: bool = False) -> Engine:
    """The engine over a transformers target (+ a drafter) on torch, for one row or a batch of rows. compile: the
    target's decoding forwards compiled over a static cache of `cache_len` positions; compile_draft (default: on
    CUDA only) the drafter's too, at fixed shapes over a static context buffer. On a CPU it gains nothing end to end
    (the bundled pair, Intel Xeon: a draft 3.8 ms compiled against 4.0 ms eager, 472 against 466 tok/s with
    --compile --verify chain, 504 against 505 with auto), so there it runs eagerly and compiles nothing more."""
    target = TorchTarget(model, drafter.spec.target_layer_ids if drafter is not None else None,
                         cache_len=cache_len, compile=compile)
    draft = None
    if drafter is not None:
        block_size = drafter_block_size(drafter, target.info, block_size, validated)
        static = None
        if compile_draft is None:
            compile_draft = compile and target.device.type == "cuda"
        if compile_draft:
            if cache_len is None or draft_window is not None:
                raise DFlashError("compile: the compiled drafter needs cache_len (a static cache) and no draft_window")
            static = cache_len + 2 * block_size
        draft = TorchDraft(drafter, model.get_input_embeddings(), model.get_output_embeddings(),
                           window=draft_window, static_capacity=static,
                           logit_scaling=drafter.spec.logit_scaling(target.info))
    target.warm_up()
    return Engine(target, draft, block_size=block_size or 1, prefill_chunk=prefill_chunk, name="torch")
