"""DraftSpec: the drafter's config.json (the format z-lab, vLLM and SGLang share) as a validated dataclass.

The checkpoint config is a Qwen3 config plus `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers` and `dflash_config: {target_layer_ids, mask_token_id}`. DFlash2 drafters
(`["DFlash2DraftModel"]`) add to `dflash_config` the convolution (`conv_kernel_size`, `conv_group_size`) and the
candidate selector (`selector_rank`, `selector_top_k`). Either may carry `output_multiplier`,
`final_logit_softcapping` and `input_embedding_scale`; a DFlash drafter may carry a draft vocabulary
(`draft_vocab_size` at top level: dflash.core.draft_vocab). Unknown keys other tools add (top level or inside
`dflash_config`) are kept and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from .errors import DFlashError, SettingError
from .io import atomic_write_text, read_json_config

ARCHITECTURE = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
ARCHITECTURES = (ARCHITECTURE, DFLASH2)
# dflash_config keys a DFlash2 drafter must set (the convolution and the candidate selector)
_DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_SCALES = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
# Ablation drafters (torch only, docs/training.md section 5), marked in config.json as dflash_config.context_mode:
#   none   no target features at all: attention sees only the block (anchor + mask slots)
#   input  input fusion (EAGLE-style): the projected target feature of the last context position is added to every
#          block slot's input embedding; no context K/V
# "kv", DFlash's K/V injection into every draft layer, is the only mode the public format (vLLM, SGLang, z-lab) has.
ABLATION_CONTEXT_MODES = ("none", "input")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# Keys of config.json that DraftSpec owns; everything else round-trips through `extra`.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass
class TargetInfo:
    """What a drafter must agree with in its target, read from the target's config and embedding table."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int  # rows of the input embedding table
    model_type: str = ""
    rope_theta: float | None = None
    final_logit_softcapping: float | None = None  # the target's own cap (Gemma), inherited by drafters without one


@dataclass
class DraftSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False
    layer_types: list[str] | None = None
    architecture: str = ARCHITECTURE
    # DFlash2: the two-tap dynamic convolutions and the candidate selector (None for DFlash)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # draft logits = softcap(lm_head(h) * output_multiplier); block embeddings * input_embedding_scale
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    # the draft vocabulary (dflash.core.draft_vocab): rows of the drafter's own LM head; None = the target's head
    draft_vocab_size: int | None = None
    # How the drafter reads the target: "kv" (DFlash, the public format) or one of ABLATION_CONTEXT_MODES.
    context_mode: str = "kv"
    extra: dict = field(default_factory=dict)
    extra_dflash: dict = field(default_factory=dict)  # dflash_config keys we do not read, written back unchanged

    # ---- derived -----------------------------------------------------------------------------------------------
    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2

    @property
    def draft_vocab(self) -> int:
        """The draft vocabulary's size (a drafter with one only)."""
        if self.draft_vocab_size is None:
            raise ValueError("this drafter has no draft vocabulary")
        return self.draft_vocab_size

    @property
    def has_draft_vocab(self) -> bool:
        """Whether the drafter scores a subset of the target's vocabulary with its own head (a draft_vocab_size
        equal to vocab_size is the whole vocabulary: vLLM and speculators read it as no draft vocabulary)."""
        return self.draft_vocab_size is not None and self.draft_vocab_size != self.vocab_size

    def logit_scaling(self, target: TargetInfo | None = None) -> tuple[float, float | None]:
        """(multiplier, softcap) of the draft logits: the drafter's own when it sets either, else the target's cap
        (the authors' rule: a drafter without its own inherits the target's)."""
        if self.output_multiplier is not None or self.final_logit_softcapping is not None:
            return (1.0 if self.output_multiplier is None else self.output_multiplier), self.final_logit_softcapping
        return 1.0, target.final_logit_softcapping if target is not None else None

    def window_for_layer(self, i: int) -> int | None:
        """Sliding-window size of draft layer i, or None for full attention."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window if self.use_sliding_window else None

    def causal_for_layer(self, i: int) -> bool:
        """Whether draft layer i is causal inside the block: the checkpoint's `is_causal` when it sets one, else
        exactly the sliding-window layers (the rule of z-lab's reference drafters, torch and MLX)."""
        flag = self.extra.get("is_causal")
        return self.window_for_layer(i) is not None if flag is None else bool(flag)

    # ---- config.json ---------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "DraftSpec":
        if not isinstance(cfg, dict):
            raise DFlashError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures")
        if archs is not None and (not isinstance(archs, list) or not any(a in archs for a in ARCHITECTURES)):
            raise DFlashError(f"{source}: architectures is {json.dumps(archs)}, expected [\"{ARCHITECTURE}\"] or "
                              f"[\"{DFLASH2}\"] (is this a target model rather than a DFlash drafter?)")
        architecture = DFLASH2 if archs is not None and DFLASH2 in archs else ARCHITECTURE
        for key in _REQUIRED:
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
        n_heads = _int(cfg, "num_attention_heads", source)
        hidden = _int(cfg, "hidden_size", source)
        rope_params = cfg["rope_parameters"] if isinstance(cfg.get("rope_parameters"), dict) else {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 1_000_000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise DFlashError(f"{source}: field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        num_layers = _int(cfg, "num_hidden_layers", source)
        layer_types = cfg.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != num_layers
                                        or not all(isinstance(t, str) for t in layer_types)):
            raise DFlashError(f"{source}: field 'layer_types' must list one type per draft layer ({num_layers})")
        if not isinstance(layer_ids, list) or not layer_ids or not all(_is_int(i) for i in layer_ids):
            raise DFlashError(f"{source}: field 'dflash_config.target_layer_ids' must be a non-empty list of ints, "
                              f"got {layer_ids!r}")
        if architecture == DFLASH2:
            for key in _DFLASH2_REQUIRED:
                if key not in dcfg:
                    raise DFlashError(f"{source}: missing required field 'dflash_config.{key}' (a {DFLASH2} sets it)")
        dflash2 = {key: _optional_int({f"dflash_config.{key}": dcfg.get(key)}, f"dflash_config.{key}", source)
                   for key in _DFLASH2_REQUIRED}
        scales = {key: _optional_float({f"dflash_config.{key}": dcfg.get(key, cfg.get(key))}, f"dflash_config.{key}",
                                       source) for key in _SCALES}
        owned = set(f.name for f in dataclasses.fields(cls)) | {"architectures", "dflash_config", "rope_parameters",
                                                                "model_type", "torch_dtype", "dtype"}
        owned_dflash = {"target_layer_ids", "mask_token_id", "block_size", *_DFLASH2_REQUIRED, *_SCALES}
        spec = cls(
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=_int(cfg, "num_key_value_heads", source, default=n_heads),
            head_dim=_int(cfg, "head_dim", source, default=hidden // max(n_heads, 1)),
            intermediate_size=_int(cfg, "intermediate_size", source),
            vocab_size=_int(cfg, "vocab_size", source),
            num_target_layers=_int(cfg, "num_target_layers", source, default=-1),
            target_layer_ids=[int(i) for i in layer_ids],
            mask_token_id=_int(dcfg if "mask_token_id" in dcfg else cfg, "mask_token_id", source),
            block_size=_int({"block_size": block_size}, "block_size", source),
            rms_norm_eps=_float(cfg, "rms_norm_eps", source, 1e-6),
            rope_theta=_float({"rope_theta": rope_theta}, "rope_theta", source, 1e6),
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=40960),
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=_optional_int(cfg, "sliding_window", source),
            use_sliding_window=bool(cfg.get("use_sliding_window", False)),
            layer_types=layer_types,
            architecture=architecture,
            **dflash2,
            output_multiplier=scales["output_multiplier"],
            final_logit_softcapping=scales["final_logit_softcapping"],
            input_embedding_scale=scales["input_embedding_scale"],
            draft_vocab_size=_optional_int(cfg, "draft_vocab_size", source),
            context_mode=dcfg.get("context_mode", "kv"),
            extra={k: v for k, v in cfg.items() if k not in owned},
            extra_dflash={k: v for k, v in dcfg.items() if k not in owned_dflash},
        )
        spec.check(source)
        return spec

    def check(self, source: str = "config.json") -> None:
        """Internal consistency (independent of any target)."""
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise DFlashError(f"{source}: field '{name}' must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError(f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.block_size < 2:
            raise DFlashError(f"{source}: field 'block_size' must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id:
            raise DFlashError(f"{source}: field 'dflash_config.mask_token_id' must be >= 0, got {self.mask_token_id}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if self.num_target_layers != -1 and bad:
            raise DFlashError(f"{source}: dflash_config.target_layer_ids {bad} out of range for "
                              f"num_target_layers={self.num_target_layers} (expected 0..{self.num_target_layers - 1})")
        if self.layer_types is not None and any(t not in ("full_attention", "sliding_attention")
                                                for t in self.layer_types):
            raise DFlashError(f"{source}: field 'layer_types' entries must be 'full_attention' or 'sliding_attention'")
        if self.is_dflash2:
            for name in _DFLASH2_REQUIRED:
                if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                    raise DFlashError(f"{source}: field 'dflash_config.{name}' must be a positive int, got "
                                      f"{getattr(self, name)!r}")
            assert self.conv_group_size and self.conv_kernel_size and self.selector_top_k  # (positive ints: above)
            if self.hidden_size % self.conv_group_size:
                raise DFlashError(f"{source}: field 'dflash_config.conv_group_size' ({self.conv_group_size}) must "
                                  f"divide hidden_size ({self.hidden_size})")
            if self.conv_kernel_size > self.block_size:
                raise DFlashError(f"{source}: field 'dflash_config.conv_kernel_size' ({self.conv_kernel_size}) must "
                                  f"be at most block_size ({self.block_size})")
            if self.selector_top_k > self.vocab_size:
                raise DFlashError(f"{source}: field 'dflash_config.selector_top_k' ({self.selector_top_k}) must be at "
                                  f"most vocab_size ({self.vocab_size})")
        if self.draft_vocab_size is not None:
            if not _is_int(self.draft_vocab_size) or not 1 <= self.draft_vocab_size <= self.vocab_size:
                raise DFlashError(f"{source}: field 'draft_vocab_size' must be an int in 1..vocab_size "
                                  f"({self.vocab_size}), got {self.draft_vocab_size!r}")
            if self.has_draft_vocab and self.is_dflash2:
                raise DFlashError(f"{source}: field 'draft_vocab_size': a draft vocabulary is supported for "
                                  f"{ARCHITECTURE} only (the {DFLASH2} selector scores the whole vocabulary)")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise DFlashError(f"{source}: field 'dflash_config.final_logit_softcapping' must be positive, got "
                              f"{self.final_logit_softcapping}")
        sliding = any(self.window_for_layer(i) is not None for i in range(self.num_hidden_layers))
        if sliding:
            if not _is_int(self.sliding_window) or self.sliding_window < 1:
                raise DFlashError(f"{source}: field 'sliding_window' must be a positive int when sliding layers are "
                                  f"used, got {self.sliding_window!r}")
        if self.context_mode not in ("kv",) + ABLATION_CONTEXT_MODES:
            raise DFlashError(f"{source}: field 'dflash_config.context_mode' must be one of kv, "
                              f"{', '.join(ABLATION_CONTEXT_MODES)}; got {self.context_mode!r}")
        if self.context_mode != "kv" and (sliding or self.extra.get("is_causal")):
            raise DFlashError(f"{source}: dflash_config.context_mode {self.context_mode!r} (an ablation mode) runs "
                              "full, non-causal attention layers only; drop sliding_window / layer_types / is_causal")

    @property
    def uses_target_features(self) -> bool:
        return self.context_mode != "none"

    @property
    def context_kv(self) -> bool:
        """Whether the target's features are K/V context of every draft layer (DFlash) rather than absent or fused
        into the block's input (the ablation modes, whose attention sees only the block)."""
        return self.context_mode == "kv"

    def check_public(self, what: str) -> None:
        """Refuse a drafter the public DFlash format cannot represent (an ablation mode) where it would leave this
        toolkit's torch backend: `what` names the flag or backend that refuses it."""
        if self.context_mode != "kv":
            raise DFlashError(f"{what}: this drafter's dflash_config.context_mode is {self.context_mode!r}, an "
                              "ablation mode of the torch backend only; the public DFlash format (vLLM, SGLang) "
                              "and the MLX backend have K/V injection (context_mode kv) only")

    def to_dict(self) -> dict:
        cfg = dict(self.extra)
        dflash_config = dict(self.extra_dflash)
        dflash_config.update(target_layer_ids=list(self.target_layer_ids), mask_token_id=self.mask_token_id,
                             block_size=self.block_size)
        for name in (*_DFLASH2_REQUIRED, *_SCALES):
            if getattr(self, name) is not None:
                dflash_config[name] = getattr(self, name)
        if self.is_dflash2:  # transformers 5 spelling, as the public DFlash2 configs write it
            cfg["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        cfg.update(
            architectures=[self.architecture],
            model_type=self.extra.get("model_type", "qwen3"),
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            sliding_window=self.sliding_window,
            use_sliding_window=self.use_sliding_window,
            layer_types=self.layer_types or ["full_attention"] * self.num_hidden_layers,
            hidden_act="silu",
            tie_word_embeddings=False,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config=dflash_config,
        )
        if self.draft_vocab_size is not None:  # only drafters with one carry the key: the public format unchanged
            cfg["draft_vocab_size"] = self.draft_vocab_size
        if self.context_mode != "kv":  # only ablation drafters carry the key: public checkpoints stay as they were
            cfg["dflash_config"]["context_mode"] = self.context_mode
        return cfg

    # ---- files ---------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, directory: str | os.PathLike) -> "DraftSpec":
        directory = Path(directory)
        if not directory.is_dir():
            raise DFlashError(f"{directory}: draft directory does not exist")
        path = directory / CONFIG_NAME
        cfg = read_json_config(path, "a DFlash drafter directory needs config.json and model.safetensors")
        return cls.from_dict(cfg, source=str(path))

    def save(self, directory: str | os.PathLike) -> None:
        atomic_write_text(Path(directory) / CONFIG_NAME, json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- agreement with a target ---------------------------------------------------------------------------------
    def validate_against(self, target: TargetInfo, source: str = "draft") -> None:
        if self.hidden_size != target.hidden_size:
            raise DFlashError(f"{source}: hidden_size {self.hidden_size} does not match the target's "
                              f"{target.hidden_size}")
        if self.num_target_layers not in (-1, target.num_hidden_layers):
            raise DFlashError(f"{source}: num_target_layers {self.num_target_layers} does not match the target's "
                              f"{target.num_hidden_layers} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise DFlashError(f"{source}: dflash_config.target_layer_ids {bad} out of range for a target with "
                              f"{target.num_hidden_layers} layers (expected 0..{target.num_hidden_layers - 1})")
        if self.vocab_size != target.vocab_size:
            raise DFlashError(f"{source}: vocab_size {self.vocab_size} does not match the target's embedding table "
                              f"({target.vocab_size} rows)")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DFlashError(f"{source}: dflash_config.mask_token_id {self.mask_token_id} is outside the target's "
                              f"embedding table (expected 0..{target.vocab_size - 1})")


def check_block_size(block_size: int, spec: DraftSpec) -> None:
    """A drafter runs at any block size from 2 up to the one it was trained for; beyond, its extra slots would
    propose from positions it never learned, so we refuse rather than silently waste verify compute."""
    if not 2 <= block_size <= spec.block_size:
        raise SettingError("block_size", f"got {block_size}, expected 2..{spec.block_size} (the drafter's trained "
                           "block_size; use --no-draft for plain decoding)")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to layer L-3 (one per draft layer); a 1-layer draft uses L//2."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(num_target_layers - 3, 1)
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(cfg: dict, key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if not _is_int(value):
        raise DFlashError(f"{source}: field '{key}' must be an integer, got {value!r}")
    return value


def _optional_int(cfg: dict, key: str, source: str) -> int | None:
    return None if cfg.get(key) is None else _int(cfg, key, source)


def _optional_float(cfg: dict, key: str, source: str) -> float | None:
    return None if cfg.get(key) is None else _float(cfg, key, source, 0.0)


def _float(cfg: dict, key: str, source: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DFlashError(f"{source}: field '{key}' must be a finite number, got {value!r}")
    return float(value)


def drafter_block_size(drafter, target_info, block_size: int | None, validated: bool = False) -> int:
    """The block size a drafter runs at (its trained one unless asked for another), after its spec is checked against
    the target, unless the loader already did that before reading the drafter's weights."""
    spec = drafter.spec
    if not validated:
        spec.validate_against(target_info, source=drafter.source)
    block_size = block_size or spec.block_size
    check_block_size(block_size, spec)
    return block_size
