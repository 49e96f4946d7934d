"""What each backend's loader reads from a target's config.json: transformers' config class (the torch backend) and
mlx-lm's ModelArgs (the MLX backend). A field they read differently makes the same weights compute two different
models, silently: mlx-lm 0.32's llama ModelArgs takes rope_theta 10000 from a transformers-5 config that keeps the
model's 100000 inside `rope_parameters`. Only configs are parsed (mlx-lm's model is built lazily, no weight is read).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from dflash.core.errors import DFlashError

# the RoPE scaling keys the two libraries' RoPE classes read (llama3, linear, dynamic, yarn)
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim")
FIELDS = ("rope_theta", "rope_type", "rope_scaling", "partial_rotary_factor", "head_dim", "rms_norm_eps",
          "tie_word_embeddings", "num_key_value_heads")


def _scaling(rope: dict, rope_type: str | None) -> dict:
    return {} if rope_type == "default" else {k: rope[k] for k in SCALING_KEYS if k in rope}


def transformers_reading(model_dir: str | os.PathLike) -> dict:
    """FIELDS as transformers' config class resolves them (rope fields None for per-layer-type RoPE)."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    except (ValueError, KeyError, OSError) as e:
        raise DFlashError(f"{Path(model_dir) / 'config.json'}: transformers cannot read it "
                          f"({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None
    rope = text.rope_parameters or {}
    flat = not any(isinstance(v, dict) for v in rope.values())
    rope_type = rope.get("rope_type", "default") if flat else None
    return {
        "rope_theta": rope.get("rope_theta") if flat else None,
        "rope_type": rope_type,
        "rope_scaling": _scaling(rope, rope_type) if flat else None,
        "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0) if flat else None,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "rms_norm_eps": getattr(text, "rms_norm_eps", None),
        "tie_word_embeddings": text.tie_word_embeddings,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
    }


def mlx_reading(config: dict, source: str) -> dict | None:
    """FIELDS as mlx-lm's ModelArgs of the config's family hold them (the text model's, for a multimodal config);
    None without mlx-lm. `config` is config.json's object as the loader in question passes it to mlx-lm."""
    try:
        from mlx_lm.utils import MODEL_REMAPPING
    except ImportError:
        return None
    model_type = config.get("model_type", "")
    try:
        arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    except ImportError:
        raise DFlashError(f"{source}: model_type {model_type!r} is not a model mlx-lm knows") from None
    try:
        model = arch.Model(arch.ModelArgs.from_dict(config))  # lazy: parameters are never evaluated
    except (TypeError, ValueError, KeyError) as e:
        raise DFlashError(f"{source}: mlx-lm cannot read it ({(str(e).strip().splitlines() or [type(e).__name__])[0]})"
                          ) from None
    args = vars((model["language_model"] if "language_model" in model else model).args)
    rope = args.get("rope_scaling") or {}
    rope_type = rope.get("type") or rope.get("rope_type") or "default"
    return {
        "rope_theta": args.get("rope_theta"),
        "rope_type": rope_type,
        "rope_scaling": _scaling(rope, rope_type),
        "partial_rotary_factor": args.get("partial_rotary_factor", 1.0),  # families without it rotate whole heads
        "head_dim": args.get("head_dim") or args["hidden_size"] // args["num_attention_heads"],
        "rms_norm_eps": args.get("rms_norm_eps"),
        "tie_word_embeddings": args.get("tie_word_embeddings"),
        "num_key_value_heads": args.get("num_key_value_heads") or args["num_attention_heads"],
    }


def differences(reference: dict, other: dict) -> list[str]:
    """'field B (transformers: A)' for every field both readings define and `other` reads differently."""
    return [f"{field} {show(other[field])} (transformers: {show(reference[field])})" for field in FIELDS
            if reference.get(field) is not None and other.get(field) is not None and reference[field] != other[field]]


def show(x) -> str:
    return format(x, "g") if isinstance(x, float) else str(x)
