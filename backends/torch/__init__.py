"""PyTorch backend: transformers targets, the DFlash drafter as an nn.Module, training.

Applications use the names below (imported on first use, so `import dflash.backends.torch` costs nothing until a
model is loaded); the modules under this package are the backend's own business.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "torch_engine": "backend", "load_target": "target", "resolve_device": "target", "resolve_dtype": "target",
    "target_info": "target", "DTYPES": "target", "quiet_loading": "target", "GROUPED_SDPA": "target",
    "DFlashDrafter": "drafter",
    "load_drafter": "drafter",
    "save_drafter": "drafter", "with_draft_vocab": "drafter", "regenerate": "regeneration",
    "write_self_prompts": "self_prompts",
    "write_draft_vocab": "draft_vocab", "write_feature_cache": "training.features",
    "TrainConfig": "training", "train": "training", "dflash_loss": "training",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)


def load(target_dir, draft_dir=None, *, dtype: str = "auto", device: str = "auto", block_size: int | None = None,
         draft_window: int | None = None, trust_remote_code: bool = False, prefill_chunk: int = 2048,
         cache_len: int | None = None, compile: bool = False, spec=None, target_config: dict | None = None):
    """The engine over a target directory (+ drafter directory). `spec` / `target_config`: what the caller already
    read and checked (dflash.api.load does), so nothing is validated twice."""
    from dflash.core.model_files.checkpoint import load_pair

    from .backend import torch_engine
    from .drafter import load_drafter
    from .target import load_target, resolve_device, resolve_dtype, target_info

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    model, drafter = load_pair(
        draft_dir, spec,
        lambda: load_target(target_dir, torch_dtype, device, trust_remote_code=trust_remote_code,
                            checked=target_config),
        target_info, lambda model, spec: load_drafter(draft_dir, dtype=torch_dtype, device=device, spec=spec))
    return torch_engine(model, drafter, block_size=block_size, draft_window=draft_window, prefill_chunk=prefill_chunk,
                        cache_len=cache_len, compile=compile, validated=True)
