"""Does a drafter fit a target? Read both checkpoints' configs and weight headers only (no model is built)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash.core.model_files.checkpoint import INDEX_NAME, read_header, validate_weights
from dflash.core.errors import DFlashError
from dflash.core.spec import DraftSpec, TargetInfo
from dflash.core.model_files.target_config import with_legacy_fields

from . import readings


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DFlashError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None


def embedding_rows(model_dir: Path) -> int | None:
    """Rows of the target's input embedding table, from the safetensors headers (quantized tables keep their rows)."""
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = sorted({model_dir / f for k, f in weight_map.items() if k.endswith("embed_tokens.weight")}) or files
    for f in files:
        for name, (_, shape) in read_header(f).items():
            if name.endswith("embed_tokens.weight"):
                return shape[0]
    return None


def tokenizer_size(model_dir: Path) -> int | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = json.loads(path.read_text())
        ids = list(tok.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in tok.get("added_tokens", [])]
        return max(ids) + 1 if ids else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
        return None


def target_summary(model_dir: str | os.PathLike) -> tuple[TargetInfo, dict]:
    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json")
    cfg = cfg.get("text_config", cfg)
    for key in ("hidden_size", "num_hidden_layers"):
        if not isinstance(cfg.get(key), int):
            raise DFlashError(f"{model_dir / 'config.json'}: missing integer field '{key}' (is this a target model?)")
    rows = embedding_rows(model_dir) or cfg.get("vocab_size")
    rope = cfg.get("rope_parameters") or {}
    info = TargetInfo(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"], vocab_size=rows,
                      model_type=cfg.get("model_type", ""), rope_theta=rope.get("rope_theta", cfg.get("rope_theta")))
    quant = cfg.get("quantization") or {}
    return info, {"tokenizer_size": tokenizer_size(model_dir), "quantization_bits": quant.get("bits")}


def check(model_dir: str | os.PathLike, draft_dir: str | os.PathLike) -> dict:
    """Validate the pair (DFlashError with one line on the first mismatch) and return the compatibility report."""
    spec = DraftSpec.load(draft_dir)
    info, extra = target_summary(model_dir)
    spec.validate_against(info, source=str(draft_dir))  # the pair first: a config mismatch says the most
    validate_weights(spec, draft_dir, allow_quantized=True)
    notes: list[str] = []
    loaders = loader_readings(Path(model_dir), notes)
    if info.rope_theta is not None and float(info.rope_theta) != spec.rope_theta:
        notes.append(f"rope_theta differs (drafter {spec.rope_theta:g}, target {float(info.rope_theta):g}); fine "
                     "if the drafter was trained that way")
    tok = extra["tokenizer_size"]
    if tok is not None and spec.mask_token_id < tok:
        notes.append(f"mask_token_id {spec.mask_token_id} is an ordinary token of the tokenizer (size {tok}); "
                     "public drafters use the first spare row past it")
    return {
        "compatible": True,
        "target": {"dir": str(model_dir), "model_type": info.model_type, "hidden_size": info.hidden_size,
                   "num_hidden_layers": info.num_hidden_layers, "embedding_rows": info.vocab_size,
                   "tokenizer_size": tok, "rope_theta": info.rope_theta, "quantization_bits": extra["quantization_bits"]},
        "draft": {"dir": str(draft_dir), "architecture": spec.architecture,
                  "num_hidden_layers": spec.num_hidden_layers, "hidden_size": spec.hidden_size,
                  "target_layer_ids": spec.target_layer_ids, "num_target_layers": spec.num_target_layers,
                  "vocab_size": spec.vocab_size, "draft_vocab_size": spec.draft_vocab_size if spec.has_draft_vocab
                  else None, "mask_token_id": spec.mask_token_id, "block_size": spec.block_size,
                  "rope_theta": spec.rope_theta, "rope_scaling": spec.rope_scaling,
                  "quantization_bits": (spec.extra.get("quantization") or {}).get("bits"),
                  "selector": ({"rank": spec.selector_rank, "top_k": spec.selector_top_k,
                                "conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size}
                               if spec.is_dflash2 else None)},
        "loaders": loaders,
        "notes": notes,
    }


def loader_readings(model_dir: Path, notes: list[str]) -> dict:
    """The target's config as transformers (the torch backend), dflash's MLX backend (mlx-lm's ModelArgs of the
    config with its RoPE keys also at the top level) and mlx-lm's own loader (the file as it is) read it. DFlashError
    on the first field one of the MLX readings takes differently from transformers, or when only dflash's reading
    works; a library that cannot read the config at all (or is not installed) is left out with a note."""
    path = model_dir / "config.json"
    out: dict[str, dict | None] = {"transformers": None, "mlx": None}
    try:
        out["transformers"] = reference = readings.transformers_reading(model_dir)
        config = _read_json(path)
        ours = readings.mlx_reading(with_legacy_fields(config), str(path))
    except DFlashError as e:
        notes.append(f"{e}: the loaders' readings are not compared")
        return out
    if ours is None:
        notes.append("mlx-lm is not installed: what the MLX backend reads from the target's config is not compared")
        return out
    out["mlx"] = ours
    if diff := readings.differences(reference, ours):
        raise DFlashError(f"{path}: dflash's MLX backend reads {'; '.join(diff)}: the two backends would run "
                          "different models")
    remedy = ("not finding the keys transformers 5 writes inside rope_parameters; `python -m dflash.models fetch "
              "NAME` updates a prepared model, `python -m dflash.convert target-to-mlx` writes a directory both read "
              "alike")
    try:
        theirs = readings.mlx_reading(config, str(path))
    except DFlashError as e:
        raise DFlashError(f"{e} as the file stands (mlx-lm's own loader), {remedy}") from None
    assert theirs is not None  # (mlx-lm is installed: `ours` was read)
    if diff := readings.differences(reference, theirs):
        raise DFlashError(f"{path}: mlx-lm's own loader reads {'; '.join(diff)}, {remedy}")
    return out


def report_lines(r: dict) -> list[str]:
    t, d = r["target"], r["draft"]
    tq = f", {t['quantization_bits']}-bit" if t["quantization_bits"] else ""
    dq = f", {d['quantization_bits']}-bit" if d["quantization_bits"] else ""
    return [
        f"target  {t['dir']}: {t['model_type'] or '?'}{tq}, {t['num_hidden_layers']} layers, hidden "
        f"{t['hidden_size']}, {t['embedding_rows']} embedding rows"
        + (f" (tokenizer {t['tokenizer_size']})" if t["tokenizer_size"] else ""),
        f"draft   {d['dir']}: {d['architecture']}, {d['num_hidden_layers']} layers{dq}, block {d['block_size']}",
        *([f"  selector         top {d['selector']['top_k']} of the draft logits, rank {d['selector']['rank']}; "
           f"{d['selector']['conv_kernel_size']}-tap convolutions, groups of {d['selector']['conv_group_size']}"]
          if d["selector"] else []),
        f"  hidden size      {d['hidden_size']} = {t['hidden_size']}",
        f"  target layers    {d['target_layer_ids']} of {t['num_hidden_layers']}"
        + (f" (draft expects {d['num_target_layers']})" if d["num_target_layers"] != -1 else ""),
        f"  vocabulary       {d['vocab_size']} = {t['embedding_rows']} embedding rows"
        + (f"; draft vocabulary of {d['draft_vocab_size']} (own head, d2t / t2d)" if d["draft_vocab_size"] else ""),
        f"  mask token       {d['mask_token_id']}",
        f"  rope             theta {d['rope_theta']:g} (target {t['rope_theta'] if t['rope_theta'] is None else format(float(t['rope_theta']), 'g')})"
        + (f", scaling {d['rope_scaling']}" if d["rope_scaling"] else ""),
        *_loader_lines(r["loaders"]),
        *[f"note: {n}" for n in r["notes"]],
        "compatible",
    ]


def _loader_lines(loaders: dict) -> list[str]:
    t = loaders["transformers"]
    if t is None:
        return []
    show = readings.show
    rope = f"theta {show(t['rope_theta'])} ({t['rope_type']})" if t["rope_theta"] is not None else "per layer type"
    if t["rope_scaling"]:
        rope += f" {t['rope_scaling']}"
    if t["partial_rotary_factor"] not in (None, 1.0):
        rope += f", {show(t['partial_rotary_factor'])} of each head"
    who = "transformers = mlx-lm" if loaders["mlx"] is not None else "transformers"
    return [f"  target config    {who}: rope {rope}, head dim {t['head_dim']}, rms eps {show(t['rms_norm_eps'])}, "
            f"{t['num_key_value_heads']} kv heads, {'tied' if t['tie_word_embeddings'] else 'untied'} embeddings"]
