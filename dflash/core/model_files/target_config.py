"""A target's RoPE settings in both spellings of config.json.

transformers 5 writes them only inside `rope_parameters` (rope_theta, rope_type and its scaling keys,
partial_rotary_factor). Readers written for the older layout take top-level `rope_theta` / `rope_scaling` /
`partial_rotary_factor` instead and fall back to their own defaults when those are absent: mlx-lm 0.32's llama
ModelArgs silently uses rope_theta 10000 and no scaling, so a transformers-5 SmolLM2 (theta 100000) or Llama 3.1
(llama3 scaling) computes another function on MLX. `with_legacy_fields` adds the top-level keys, derived from what
transformers itself applies, so that both layouts agree; the MLX backend applies it at load (directories written
before it existed included) and every target directory dflash writes carries them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..io import atomic_write_text

DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def rope_parameters(cfg: dict) -> dict | None:
    """The one RoPE transformers 5 applies for this (text) config, as its config classes resolve it: a legacy
    `rope_scaling` replaces `rope_parameters`; a rope_theta inside wins over the top-level one. None when the config
    declares no RoPE, or one per layer type (Gemma 4: nothing single to mirror)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if params is None and "rope_theta" not in cfg:
        return None
    params = dict(params or {})
    if any(isinstance(v, dict) for v in params.values()):
        return None
    params.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_THETA))
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def legacy_fields(cfg: dict) -> dict:
    """The top-level keys an older reader takes RoPE from, for a config that has `rope_parameters`: rope_theta,
    rope_scaling (a rope type other than default) and partial_rotary_factor. Empty for a config in the old layout."""
    if not isinstance(cfg.get("rope_parameters"), dict):
        return {}
    rope = rope_parameters(cfg)
    if rope is None:
        return {}
    fields = {"rope_theta": rope["rope_theta"]}
    if rope["rope_type"] != "default" and not cfg.get("rope_scaling"):
        fields["rope_scaling"] = rope
    if "partial_rotary_factor" in rope:
        fields["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return fields


def with_legacy_fields(config: dict) -> dict:
    """A copy of a config.json object (and of its `text_config`) with legacy_fields set."""
    out = {**config, **legacy_fields(config)}
    if isinstance(config.get("text_config"), dict):
        out["text_config"] = with_legacy_fields(config["text_config"])
    return out


def write_legacy_fields(directory: str | os.PathLike) -> bool:
    """Add the legacy RoPE keys to `directory`/config.json in place (what transformers reads is unchanged); whether
    the file changed."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    fixed = with_legacy_fields(config)
    if fixed != config:
        atomic_write_text(path, json.dumps(fixed, indent=2, sort_keys=True) + "\n")
    return fixed != config
