"""The target's tokenizer and its chat helpers: a leaf module (transformers only), so backends and the trainer
can use them without importing the API layer."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DFlashError


NO_LENGTH_LIMIT = int(1e30)  # transformers' own value for a tokenizer without a maximum length


def load_tokenizer(target_dir, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                           "tokenizer.model", "vocab.json")):
        raise DFlashError(f"{target_dir}: no tokenizer files (expected tokenizer.json or tokenizer_config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"{target_dir}: cannot load the tokenizer ({first})") from None
    # Lengths are checked against the target's context where a prompt is run, with an error naming what to do;
    # nothing is truncated to the tokenizer's model_max_length, whose only effect would be transformers' own
    # "Token indices sequence length is longer than ..." warning ahead of that error.
    tokenizer.model_max_length = NO_LENGTH_LIMIT
    return tokenizer


def eos_token_ids(target_dir, tokenizer) -> set[int]:
    """Every EOS id the tokenizer, config.json and generation_config.json name."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        path = Path(target_dir) / name
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                continue
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids


def chat_ids(tokenizer, messages: list[dict], system: str | None = None, enable_thinking: bool | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("--chat: this tokenizer has no chat template; drop --chat for plain completion")
    if system:
        messages = [{"role": "system", "content": system}] + list(messages)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
