"""Tiny models built on the spot: a BPE tokenizer trained with `tokenizers` and random Qwen3/Llama targets saved in
HF format. Tests, the cost model and the reference build use these; nothing is downloaded."""

from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path

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


def target_config(family: str = "qwen3", vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 4,
                  num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
                  max_position_embeddings: int = 4096, eos_token_id: int | None = None, **overrides):
    from transformers import AutoConfig

    cfg = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
               num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
               intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
               head_dim=hidden_size // num_attention_heads, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_theta=10000.0, eos_token_id=eos_token_id)
    cfg.update(overrides)
    return AutoConfig.for_model(family, **cfg)


def build_target(directory: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None, seed: int = 0,
                 family: str = "qwen3", init_std: float | None = None, **config):
    """A random target in HF format (config.json, model.safetensors, generation_config.json, tokenizer)."""
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
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return model


def draft_spec_for(target_dir: str | os.PathLike, num_layers: int = 2, block_size: int = 16,
                   mask_token_id: int | None = None, target_layer_ids: list[int] | None = None, **overrides):
    """A DraftSpec shaped for a target directory (hidden size, heads, default layer ids, spare-row mask id)."""
    from .spec import DraftSpec, default_target_layer_ids

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
