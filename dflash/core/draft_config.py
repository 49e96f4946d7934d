"""A drafter's config.json read into DraftSpec's fields (dflash/core/spec.py), every field typed on the way in.

The format (z-lab, vLLM and SGLang share it): a Qwen3 config plus `architectures`, `block_size`, `num_target_layers`
and `dflash_config: {target_layer_ids, mask_token_id}`; a DFlash2 drafter adds DFLASH2_KEYS to `dflash_config`, and
either may carry SCALE_KEYS there (or at top level). Older and newer spellings are both read: `target_layer_ids` /
`mask_token_id` / `block_size` at top level or inside `dflash_config`, RoPE as `rope_theta` + `rope_scaling` or inside
transformers 5's `rope_parameters`. A field of the wrong type is refused with one line naming the file and the field.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

from .errors import DFlashError

ARCHITECTURE = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
ARCHITECTURES = (ARCHITECTURE, DFLASH2)
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# dflash_config keys a DFlash2 drafter must set (the convolution and the candidate selector)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SCALE_KEYS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
# dflash_config keys read into fields; any other is kept and written back unchanged
DFLASH_CONFIG_KEYS = frozenset({"target_layer_ids", "mask_token_id", "block_size", *DFLASH2_KEYS, *SCALE_KEYS})


def read_fields(cfg: dict, source: str) -> dict[str, Any]:
    """DraftSpec's fields from config.json (`source` names it in errors), `extra_dflash` included and `extra` (the
    top-level keys DraftSpec does not own) left to it."""
    if not isinstance(cfg, dict):
        raise DFlashError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not any(a in archs for a in ARCHITECTURES)):
        raise DFlashError(f"{source}: architectures is {json.dumps(archs)}, expected [\"{ARCHITECTURE}\"] or "
                          f"[\"{DFLASH2}\"] (is this a target model rather than a DFlash drafter?)")
    architecture = DFLASH2 if archs is not None and DFLASH2 in archs else ARCHITECTURE
    for key in REQUIRED_KEYS:
        if key not in cfg:
            raise DFlashError(f"{source}: missing required field '{key}'")
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise DFlashError(f"{source}: field 'dflash_config' must be an object")
    if "target_layer_ids" not in dcfg and "target_layer_ids" not in cfg:
        raise DFlashError(f"{source}: missing required field 'dflash_config.target_layer_ids'")
    if "mask_token_id" not in dcfg and "mask_token_id" not in cfg:
        raise DFlashError(f"{source}: missing required field 'dflash_config.mask_token_id'")
    layer_ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    block_size = cfg.get("block_size", dcfg.get("block_size", 16))
    n_heads = read_int(cfg, "num_attention_heads", source)
    hidden = read_int(cfg, "hidden_size", source)
    rope_params = cfg["rope_parameters"] if isinstance(cfg.get("rope_parameters"), dict) else {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 1_000_000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise DFlashError(f"{source}: field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    num_layers = read_int(cfg, "num_hidden_layers", source)
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != num_layers
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise DFlashError(f"{source}: field 'layer_types' must list one type per draft layer ({num_layers})")
    if not isinstance(layer_ids, list) or not layer_ids or not all(is_int(i) for i in layer_ids):
        raise DFlashError(f"{source}: field 'dflash_config.target_layer_ids' must be a non-empty list of ints, "
                          f"got {layer_ids!r}")
    if architecture == DFLASH2:
        for key in DFLASH2_KEYS:
            if key not in dcfg:
                raise DFlashError(f"{source}: missing required field 'dflash_config.{key}' (a {DFLASH2} sets it)")
    dflash2 = {key: read_optional_int({f"dflash_config.{key}": dcfg.get(key)}, f"dflash_config.{key}", source)
               for key in DFLASH2_KEYS}
    scales = {key: read_optional_float({f"dflash_config.{key}": dcfg.get(key, cfg.get(key))}, f"dflash_config.{key}",
                                       source) for key in SCALE_KEYS}
    return dict(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=read_int(cfg, "num_key_value_heads", source, default=n_heads),
        head_dim=read_int(cfg, "head_dim", source, default=hidden // max(n_heads, 1)),
        intermediate_size=read_int(cfg, "intermediate_size", source),
        vocab_size=read_int(cfg, "vocab_size", source),
        num_target_layers=read_int(cfg, "num_target_layers", source, default=-1),
        target_layer_ids=[int(i) for i in layer_ids],
        mask_token_id=read_int(dcfg if "mask_token_id" in dcfg else cfg, "mask_token_id", source),
        block_size=read_int({"block_size": block_size}, "block_size", source),
        rms_norm_eps=read_float(cfg, "rms_norm_eps", source, 1e-6),
        rope_theta=read_float({"rope_theta": rope_theta}, "rope_theta", source, 1e6),
        rope_scaling=rope_scaling,
        max_position_embeddings=read_int(cfg, "max_position_embeddings", source, default=40960),
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=read_optional_int(cfg, "sliding_window", source),
        use_sliding_window=bool(cfg.get("use_sliding_window", False)),
        layer_types=layer_types,
        architecture=architecture,
        **dflash2,
        **scales,
        draft_vocab_size=read_optional_int(cfg, "draft_vocab_size", source),
        context_mode=dcfg.get("context_mode", "kv"),
        extra_dflash={k: v for k, v in dcfg.items() if k not in DFLASH_CONFIG_KEYS},
    )


def is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def read_int(cfg: dict, key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if not is_int(value):
        raise DFlashError(f"{source}: field '{key}' must be an integer, got {value!r}")
    return value


def read_optional_int(cfg: dict, key: str, source: str) -> int | None:
    return None if cfg.get(key) is None else read_int(cfg, key, source)


def read_optional_float(cfg: dict, key: str, source: str) -> float | None:
    return None if cfg.get(key) is None else read_float(cfg, key, source, 0.0)


def read_float(cfg: dict, key: str, source: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DFlashError(f"{source}: field '{key}' must be a finite number, got {value!r}")
    return float(value)
