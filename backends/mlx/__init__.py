"""MLX backend: mlx-lm targets (float or mlx-community 4/8-bit), the DFlash drafter as an mlx.nn.Module.

dtype "auto" means float32 when MLX runs on the CPU and the checkpoint's own dtype (usually bfloat16) on Metal.
"""

from __future__ import annotations

import importlib

_PUBLIC = {"mlx_engine": "backend", "load_target": "target", "resolve_device": "target", "resolve_dtype": "target",
           "DFlashDrafter": "drafter", "load_drafter": "drafter"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)


def load(target_dir, draft_dir=None, *, dtype: str = "auto", device: str = "auto", block_size: int | None = None,
         draft_window: int | None = None, trust_remote_code: bool = False, prefill_chunk: int = 2048, spec=None,
         target_config: dict | None = None):
    import mlx.core as mx

    from dflash.core.model_files.checkpoint import load_pair

    from .backend import mlx_engine
    from .drafter import load_drafter
    from .target import load_target, resolve_device, resolve_dtype, target_info

    mx_device = resolve_device(device)
    mx.set_default_device(mx_device)
    mx_dtype = resolve_dtype(dtype, mx_device)
    # the drafter computes in the dtype the target's embeddings come out in
    (model, config), drafter = load_pair(
        draft_dir, spec,
        lambda: load_target(target_dir, mx_dtype, trust_remote_code=trust_remote_code, checked=target_config),
        lambda loaded: target_info(*loaded),
        lambda loaded, spec: load_drafter(draft_dir, dtype=model_dtype(loaded[0]), spec=spec), backend="mlx")
    return mlx_engine(model, config, drafter, block_size=block_size, draft_window=draft_window,
                      prefill_chunk=prefill_chunk, validated=True)


def model_dtype(model):
    import mlx.core as mx

    from .target import embedding

    return embedding(model)(mx.array([[0]])).dtype
