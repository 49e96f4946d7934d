"""The target model: any mlx-lm causal LM (including mlx-community 4/8-bit checkpoints), run so that the outputs of
the decoder layers the drafter reads are recorded, without patching mlx-lm's classes."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from dflash.core.model_files.checkpoint import check_target_dir
from dflash.core.errors import DFlashError
from dflash.core.spec import TargetInfo
from dflash.core.model_files.target_config import with_legacy_fields

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# families whose Model.__call__ is exactly `lm_head(model(inputs, cache))`: we may run the trunk and apply the head
# to the positions we need only (prefill wants the last one). Others run whole and their logits are sliced.
PLAIN_HEAD = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}


def resolve_device(name: str | None) -> mx.Device | mx.DeviceType:
    if name in (None, "auto"):
        return mx.default_device()
    if name == "cpu":
        return mx.cpu
    if name in ("gpu", "metal", "mps"):
        if not mx.is_available(mx.gpu):
            raise DFlashError(f"--device: {name} is not available to MLX on this machine (use cpu)")
        return mx.gpu
    raise DFlashError(f"--device: got {name!r}, expected auto, cpu or gpu for --backend mlx")


def resolve_dtype(name: str | None, device):
    """auto: float32 on the CPU (MLX's CPU kernels are fastest and exact there), else the checkpoint's own dtype
    (bfloat16 for most models on Metal). None = keep what the checkpoint stores."""
    if name in (None, "auto"):
        return mx.float32 if device == mx.cpu else None
    if name not in DTYPES:
        raise DFlashError(f"--dtype: got {name!r}, expected one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_target(path, dtype=None, trust_remote_code: bool = False, checked: dict | None = None):
    from mlx_lm.utils import load_config, load_model

    if checked is None:
        check_target_dir(path)  # missing / broken config.json, pickle-only or truncated weights: one line
    # a transformers-5 config keeps RoPE inside rope_parameters, where mlx-lm's ModelArgs of several families do not
    # look (llama: theta 10000 instead of the model's): hand them the top-level keys transformers' reading implies
    raw = load_config(Path(path))
    fixed = with_legacy_fields(raw)
    try:
        model, config = load_model(Path(path), trust_remote_code=trust_remote_code,
                                   model_config={k: v for k, v in fixed.items() if raw.get(k) != v})
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"{path}: cannot load the target model with mlx-lm ({first})") from None
    if dtype is not None:
        # quantized weights stay packed (uint32); their scales and every float parameter take the dtype
        model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                              model.parameters()))
        mx.eval(model.parameters())
    return model, config


def trunk(model) -> nn.Module:
    """The module holding embed_tokens / layers / norm (mlx-lm's `Model.model` for decoder-only families,
    `Model.language_model.model` for multimodal checkpoints such as Qwen3.5)."""
    model = _language_model(model)
    inner = model["model"] if "model" in model else model
    for name in ("embed_tokens", "layers"):
        if name not in inner:
            raise DFlashError(f"{type(model).__module__}: the MLX target has no '{name}'; DFlash needs a decoder "
                              "with embed_tokens and layers")
    return inner


def _language_model(model) -> nn.Module:
    """The text model of a multimodal mlx-lm Model (qwen3_5, qwen3_5_moe: `language_model`), else the model."""
    return model["language_model"] if "language_model" in model else model


def decoder_layers(model) -> list:
    return trunk(model).layers


def embedding(model):
    return trunk(model).embed_tokens


def lm_head(model):
    """The output projection: lm_head, or the tied embedding used as a linear layer (both may be quantized)."""
    model = _language_model(model)
    if "lm_head" in model:
        return model.lm_head
    return trunk(model).embed_tokens.as_linear


def target_info(model, config: dict) -> TargetInfo:
    cfg = config.get("text_config", config)
    rope = cfg.get("rope_parameters") or {}
    return TargetInfo(hidden_size=cfg["hidden_size"], num_hidden_layers=len(decoder_layers(model)),
                      vocab_size=embedding(model).weight.shape[0], model_type=cfg.get("model_type", ""),
                      rope_theta=rope.get("rope_theta", cfg.get("rope_theta")),
                      final_logit_softcapping=cfg.get("final_logit_softcapping"))


class _Tap:
    """Stands in for one decoder layer during a single forward and records its output (HF layer id i =
    hidden_states[i + 1]). Attribute reads go to the layer, so family code that inspects layers still works."""

    def __init__(self, layer, outputs: dict, i: int):
        self.layer, self.outputs, self.i = layer, outputs, i

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.outputs[self.i] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


class TappedForward:
    """Forward passes of an mlx-lm model with its own cache, recording the layers in `layer_ids`. The taps are put
    into this model instance's layer list for the duration of one call and removed after, so two runners with
    different layer ids can share a model, and nothing outlives the call."""

    def __init__(self, model, config: dict, layer_ids: list[int] | None = None):
        self.model, self.layer_ids = model, list(layer_ids or [])
        self.layers = decoder_layers(model)
        self.head = lm_head(model)
        self.split = config.get("model_type") in PLAIN_HEAD

    def __call__(self, ids: mx.array, cache: list, last_only: bool) -> tuple[mx.array, mx.array | None]:
        """ids (1, T) -> logits (1, T or 1, V) and features (1, T, K*H) (None without layer ids); both lazy."""
        outputs: dict[int, mx.array] = {}
        originals = {i: self.layers[i] for i in self.layer_ids}
        for i, layer in originals.items():
            self.layers[i] = _Tap(layer, outputs, i)
        try:
            if self.split:
                h = trunk(self.model)(ids, cache)
                logits = self.head(h[:, -1:] if last_only else h)
            else:
                logits = self.model(ids, cache=cache)
                logits = logits[:, -1:] if last_only else logits
        finally:
            for i, layer in originals.items():
                self.layers[i] = layer
        feats = mx.concatenate([outputs[i] for i in self.layer_ids], axis=-1) if self.layer_ids else None
        return logits, feats
