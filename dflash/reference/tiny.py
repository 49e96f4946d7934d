"""Tiny models built on the spot: a BPE tokenizer trained with `tokenizers` and random Qwen3/Llama targets saved in
HF format. Tests, the cost model and the reference build use these; nothing is downloaded."""

from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path
from typing import Any

from ..core.spec import DraftSpec, default_target_layer_ids
from ..core.model_files.target_config import with_legacy_fields

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def stdlib_sources(limit_bytes: int = 2_000_000, seed: int = 0, exclude: tuple[str, ...] = ("test", "idlelib")) -> list[str]:
    """Python source files of the running interpreter's standard library (present on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not any(part in exclude for part in p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int, directory: str | os.PathLike, chat_template: str | None =
                    CHATML_TEMPLATE, model_max_length: int = 4096):
    """Byte-level BPE trained with `tokenizers`, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, model_max_length=model_max_length)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return fast


# Per-family settings that keep a random target tiny while keeping what makes the family itself: experts for the MoE
# families, Gated DeltaNet linear-attention layers (3 of every 4) for Qwen3.5, alternating sliding-window attention
# with sinks for gpt-oss. Keyword arguments of target_config/build_target override them.
FAMILY_DEFAULTS: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "qwen3_5": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4),
    "qwen3_5_moe": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rms_norm_eps=1e-5),
    # Gemma 4: sliding windows on 3 of 4 layers, per-layer input embeddings, the last layers reusing earlier K/V
    "gemma4": dict(sliding_window=16, vocab_size_per_layer_input=None, hidden_size_per_layer_input=16,
                   global_head_dim=32, num_kv_shared_layers=2, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}
# Families whose public checkpoints are multimodal configs (model_type X with the language model in `text_config`,
# weights under model.language_model.*): built the same way, with a one-layer vision tower, so that transformers'
# AutoModelForCausalLM and mlx-lm load them exactly as they load the real ones.
MULTIMODAL: dict[str, dict] = {
    "qwen3_5": dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=None),
    "qwen3_5_moe": dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=None),
    "gemma4": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16),
}


def target_config(family: str = "qwen3", vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 4,
                  num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
                  max_position_embeddings: int = 4096, eos_token_id: int | None = None, **overrides):
    from transformers import AutoConfig

    cfg: dict[str, Any]
    cfg = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
               num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
               intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
               head_dim=hidden_size // num_attention_heads, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_theta=10000.0, eos_token_id=eos_token_id)
    cfg.update(FAMILY_DEFAULTS.get(family, {}))
    cfg.update(overrides)
    if family == "gemma4":
        cfg.pop("rope_theta")  # per layer type (sliding / full) in Gemma 4's own defaults
        if cfg["vocab_size_per_layer_input"] is None:
            cfg["vocab_size_per_layer_input"] = cfg["vocab_size"]
    if family in ("qwen3_5", "qwen3_5_moe") and "rope_parameters" not in cfg:
        # Qwen3.5 rotates a quarter of each head (text-only positions make its multimodal RoPE a plain one)
        rotary_pairs = int(cfg["head_dim"] * 0.25) // 2
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                                  "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                  "mrope_section": [rotary_pairs - rotary_pairs // 2, rotary_pairs // 2, 0]}
    if family in MULTIMODAL:
        vision = dict(MULTIMODAL[family])
        if "out_hidden_size" in vision:
            vision["out_hidden_size"] = cfg["hidden_size"]
        extra = {"audio_config": None} if family == "gemma4" else {}
        return AutoConfig.for_model(family, text_config=cfg, vision_config=vision,
                                    tie_word_embeddings=cfg["tie_word_embeddings"], eos_token_id=eos_token_id, **extra)
    return AutoConfig.for_model(family, **cfg)


def build_target(directory: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None, seed: int = 0,
                 family: str = "qwen3", init_std: float | None = None, **config):
    """A random target in HF format (config.json, model.safetensors, generation_config.json, tokenizer). Returns the
    causal LM as transformers loads it from that directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        config.setdefault("eos_token_id", tokenizer.eos_token_id)
        # a few spare rows past the tokenizer, like Qwen's padded vocabulary (room for the mask token)
        config.setdefault("vocab_size", len(tokenizer) + 8)
    cfg = target_config(family, **config)
    if init_std is not None:
        cfg.initializer_range = init_std
        if family in MULTIMODAL:
            cfg.text_config.initializer_range = init_std
    torch.manual_seed(seed)
    if family in MULTIMODAL:
        from transformers import AutoModelForImageTextToText

        AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).save_pretrained(str(directory))
        _public_layout(directory, cfg)
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(str(directory))
        _public_layout(directory, cfg)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return model


def _public_layout(directory: Path, cfg) -> None:
    """Write the checkpoint the way the public ones are spelled, which mlx-lm reads (transformers reads both):
    config keys under their legacy names too (`rope_theta` next to `rope_parameters`, `num_experts` for
    `num_local_experts`, ...), and Qwen3.5-MoE experts fused (`experts.gate_up_proj` / `experts.down_proj`)."""
    path = directory / "config.json"
    data = with_legacy_fields(json.loads(path.read_text()))
    text = data.get("text_config", data)
    for alias, name in getattr(type(cfg.get_text_config()), "attribute_map", {}).items():
        if name in text and alias not in text:
            text[alias] = text[name]
    path.write_text(json.dumps(data, indent=2))
    if text.get("model_type") == "qwen3_5_moe_text" or data.get("model_type") == "qwen3_5_moe":
        import re

        import torch
        from safetensors.torch import load_file, save_file

        weights = load_file(str(directory / "model.safetensors"))
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for key in [k for k in weights if re.search(r"\.mlp\.experts\.\d+\.", k)]:
            found = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", key)
            assert found is not None, key  # (every expert weight is a projection's)
            prefix, e, proj = found.groups()
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = weights.pop(key)
        for prefix, by_id in experts.items():
            ids = sorted(by_id)
            weights[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_id[e]["gate"], by_id[e]["up"]]) for e in ids])
            weights[f"{prefix}.down_proj"] = torch.stack([by_id[e]["down"] for e in ids])
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def mlx_layout(directory: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The directory mlx-lm loads for a target built here. Same files, except gpt-oss: transformers stores its experts
    as (experts, in, out) while mlx-lm reads the layout of OpenAI's checkpoint, (experts, out, in) with gate/up
    interleaved, under `.weight` names (the unquantized form of `*_blocks`). Other families load as they are."""
    import shutil

    directory, out = Path(directory), Path(out)
    if json.loads((directory / "config.json").read_text()).get("model_type") != "gpt_oss":
        return directory
    from safetensors.torch import load_file, save_file

    shutil.copytree(directory, out, dirs_exist_ok=True)
    weights = load_file(str(directory / "model.safetensors"))
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[key + ".weight"] = weights.pop(key).transpose(-1, -2).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def draft_spec_for(target_dir: str | os.PathLike, num_layers: int = 2, block_size: int = 16,
                   mask_token_id: int | None = None, target_layer_ids: list[int] | None = None, **overrides):
    """A DraftSpec shaped for a target directory (hidden size, heads, default layer ids, spare-row mask id)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    n_target = cfg["num_hidden_layers"]
    if mask_token_id is None:
        mask_token_id = cfg["vocab_size"] - 1
    fields = dict(
        hidden_size=cfg["hidden_size"], num_hidden_layers=num_layers, num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], num_target_layers=n_target,
        target_layer_ids=target_layer_ids or default_target_layer_ids(n_target, num_layers),
        mask_token_id=mask_token_id, block_size=block_size, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096))
    fields.update(overrides)
    return DraftSpec(**fields)


def dflash2_spec(spec: DraftSpec, *, selector_rank: int = 16, selector_top_k: int = 16, conv_group_size: int = 16,
                 sliding_window: int = 2048, **overrides) -> DraftSpec:
    """The DFlash2 form of a DFlash spec, laid out as the public DFlash2 configs are: every layer
    `sliding_attention`, `is_causal: false`, two-tap convolutions and a candidate selector."""
    import dataclasses

    fields: dict[str, Any]
    fields = dict(architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=conv_group_size,
                  selector_rank=selector_rank, selector_top_k=selector_top_k, sliding_window=sliding_window,
                  layer_types=["sliding_attention"] * spec.num_hidden_layers,
                  extra={**spec.extra, "is_causal": False})
    fields.update(overrides)
    return dataclasses.replace(spec, **fields)
