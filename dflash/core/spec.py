"""DraftSpec: the drafter's config.json (the format z-lab, vLLM and SGLang share) as a validated dataclass.

The checkpoint config is a Qwen3 config plus `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers` and `dflash_config: {target_layer_ids, mask_token_id}`. DFlash2 drafters
(`["DFlash2DraftModel"]`) add to `dflash_config` the convolution (`conv_kernel_size`, `conv_group_size`) and the
candidate selector (`selector_rank`, `selector_top_k`). Either may carry `output_multiplier`,
`final_logit_softcapping` and `input_embedding_scale`; a DFlash drafter may carry a draft vocabulary
(`draft_vocab_size` at top level: dflash.core.draft_vocab). Unknown keys other tools add (top level or inside
`dflash_config`) are kept and written back unchanged. Reading the fields' types is dflash/core/draft_config.py's; what
they must agree on, with each other and with a target, is this module's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .draft_config import ARCHITECTURE, DFLASH2, DFLASH2_KEYS, SCALE_KEYS, is_int, read_fields
from .errors import DFlashError, SettingError
from .io import atomic_write_text, read_json_config

# Ablation drafters (torch only, docs/training.md section 5), marked in config.json as dflash_config.context_mode:
#   none   no target features at all: attention sees only the block (anchor + mask slots)
#   input  input fusion (EAGLE-style): the projected target feature of the last context position is added to every
#          block slot's input embedding; no context K/V
# "kv", DFlash's K/V injection into every draft layer, is the only mode the public format (vLLM, SGLang, z-lab) has.
ABLATION_CONTEXT_MODES = ("none", "input")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


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
        fields = read_fields(cfg, source)  # (refuses a cfg that is not an object)
        owned = {f.name for f in dataclasses.fields(cls)} | {"architectures", "dflash_config", "rope_parameters",
                                                               "model_type", "torch_dtype", "dtype"}
        spec = cls(**fields, extra={k: v for k, v in cfg.items() if k not in owned})
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
            for name in DFLASH2_KEYS:
                if not is_int(getattr(self, name)) or getattr(self, name) < 1:
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
            if not is_int(self.draft_vocab_size) or not 1 <= self.draft_vocab_size <= self.vocab_size:
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
            if not is_int(self.sliding_window) or self.sliding_window < 1:
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
        for name in (*DFLASH2_KEYS, *SCALE_KEYS):
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


def drafter_block_size(drafter, target_info, block_size: int | None, validated: bool = False) -> int:
    """The block size a drafter runs at (its trained one unless asked for another), after its spec is checked against
    the target, unless the loader already did that before reading the drafter's weights."""
    spec = drafter.spec
    if not validated:
        spec.validate_against(target_info, source=drafter.source)
    block_size = block_size or spec.block_size
    check_block_size(block_size, spec)
    return block_size
