"""Training data: read prompt / chat rows from JSONL or a `datasets` directory, and tokenise conversations with the
target's own chat template, supervising only the assistant tokens.

Row formats accepted everywhere:
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}       (OpenAI / HF chat)
  {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}    (ShareGPT)
  {"prompt": "..."}                                                                        (plain prompt)
  {"input_ids": [...], "loss_mask": [...]}                                                 (already tokenised)
Rows may carry an "id"; rows with a "status" other than "ok" (regenerate's failures) are skipped by training.
"""

from __future__ import annotations

import gzip
import json
import os
from array import array
from pathlib import Path
from typing import Iterator

from ..errors import DFlashError
from .answer_shards import shard_paths, training_samples

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                   "tool": "tool", "function": "tool"}


# ---- reading rows --------------------------------------------------------------------------------------------------
def read_rows(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(row number, row dict) from a JSONL file or a directory saved with `datasets.Dataset.save_to_disk`."""
    path = Path(path)
    if path.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError:
            raise DFlashError(f"{path}: reading a datasets directory needs `pip install datasets`") from None
        try:
            ds = load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DFlashError(f"{path}: not a datasets directory saved with save_to_disk ({e})") from None
        if hasattr(ds, "keys"):  # a DatasetDict: take the train split, or the only one
            split = "train" if "train" in ds else next(iter(ds.keys()))
            ds = ds[split]
        for i, row in enumerate(ds):
            yield i, dict(row)
        return
    if not path.is_file():
        raise DFlashError(f"{path}: input file does not exist")
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DFlashError(f"{path}:{i + 1}: expected a JSON object per line, got {type(row).__name__}")
            yield i, row


def row_id(row: dict, index: int) -> str:
    return str(row["id"]) if row.get("id") is not None else f"row-{index}"


def row_messages(row: dict, where: str) -> list[dict]:
    """The conversation of a row as [{"role", "content"}], whichever format it came in."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise DFlashError(f"{where}: field 'messages' must be a list of {{role, content}} objects")
        return [dict(m, content=m.get("content") or "") for m in msgs]
    if "conversations" in row:
        conv = row["conversations"]
        if not isinstance(conv, list) or not all(isinstance(m, dict) and "from" in m for m in conv):
            raise DFlashError(f"{where}: field 'conversations' must be a list of {{from, value}} objects")
        out = []
        for m in conv:
            role = _SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise DFlashError(f"{where}: conversations role {m['from']!r} is not one of "
                                  f"{', '.join(sorted(_SHAREGPT_ROLES))}")
            out.append({"role": role, "content": m.get("value") or ""})
        return out
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise DFlashError(f"{where}: field 'prompt' must be a string")
        return [{"role": "user", "content": row["prompt"]}]
    raise DFlashError(f"{where}: expected a 'messages', 'conversations', 'prompt' or 'input_ids' field")


def prompt_messages(messages: list[dict]) -> list[dict]:
    """What the target is asked to answer: everything before the first assistant turn."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            return messages[:i]
    return messages


# ---- tokenisation ----------------------------------------------------------------------------------------------------
def _render(tokenizer, messages, add_generation_prompt: bool, enable_thinking: bool | None) -> str:
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_spans(tokenizer, messages: list[dict], enable_thinking: bool | None = None) -> tuple[str, list]:
    """The rendered conversation and the character spans of the assistant turns in it.

    Works for any template by diffing renders: for assistant turn i, render the prefix before it with the generation
    prompt (P) and the prefix including it (Q). Its span is Q[common_prefix(P, Q):], i.e. what the model itself would
    have to write after the generation prompt, including the end-of-turn marker; whitespace the template puts after
    that marker (ChatML's '\\n') is not something the model generates, so it is trimmed. A turn whose render Q is not
    a prefix of the full render (templates that rewrite earlier turns, e.g. dropping old reasoning) is skipped
    unless it is the last one."""
    full = _render(tokenizer, messages, False, enable_thinking)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        p = _render(tokenizer, messages[:i], True, enable_thinking)
        q = full if i == len(messages) - 1 else _render(tokenizer, messages[:i + 1], False, enable_thinking)
        if not full.startswith(q):
            continue
        start, end = _common_prefix(p, q), len(q.rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], enable_thinking: bool | None = None,
                          max_length: int | None = None) -> tuple[list[int], list[bool]]:
    """input_ids and loss_mask (True on assistant tokens, end-of-turn included) for one conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("tokenizer: the target's tokenizer has no chat_template; training data must be rendered "
                          "with the target's own template (or pass pre-tokenised input_ids/loss_mask rows)")
    text, spans = assistant_spans(tokenizer, messages, enable_thinking)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = []
    for a, b in offsets:
        # a token is supervised when it starts inside an assistant span (special tokens have real offsets too)
        mask.append(any(s <= a < e for s, e in spans) and b > a)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return list(ids), mask


def load_samples(path, tokenizer=None, *, max_length: int | None = None, enable_thinking: bool | None = None,
                 rows: tuple[int, int | None] | None = None):
    """Training samples [{"id", "input_ids": array('i'), "loss_mask": array('b')}] from JSONL / datasets rows, or
    from an answers shard directory (`python -m dflash.data answers`; `rows`: (start, stop) of it). Rows without an
    assistant turn are an error (train on the target's own answers: run `python -m dflash.data regenerate` first);
    rows whose status is not "ok" are skipped; rows with no supervised token left after truncation are dropped."""
    if Path(path).is_dir() and shard_paths(path):
        start, stop = rows or (0, None)
        samples = training_samples(path, start, stop, max_length=max_length)
        if not samples:
            raise DFlashError(f"{path}: no answers in rows {start}:{'' if stop is None else stop}")
        return samples
    if rows is not None:
        raise DFlashError(f"--data-rows: only for an answers directory (python -m dflash.data answers); {path} is "
                          "not one")
    samples, skipped = [], 0
    for i, row in read_rows(path):
        where = f"{path}:{i + 1}"
        if row.get("status", "ok") != "ok":
            skipped += 1
            continue
        if "input_ids" in row:
            ids = row["input_ids"]
            mask = row.get("loss_mask")
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise DFlashError(f"{where}: field 'input_ids' must be a list of ints")
            if mask is None:
                raise DFlashError(f"{where}: tokenised rows need a 'loss_mask' next to 'input_ids'")
            if len(mask) != len(ids):
                raise DFlashError(f"{where}: 'loss_mask' has {len(mask)} entries, 'input_ids' {len(ids)}")
            mask = [bool(x) for x in mask]
            if max_length is not None:
                ids, mask = ids[:max_length], mask[:max_length]
        else:
            messages = row_messages(row, where)
            if not any(m["role"] == "assistant" for m in messages):
                raise DFlashError(f"{where}: no assistant turn to learn from; answer the prompts with the target "
                                  "first (python -m dflash.data regenerate)")
            if tokenizer is None:
                raise DFlashError(f"{where}: chat rows need the target's tokenizer")
            think = row.get("thinking", enable_thinking) if enable_thinking is None else enable_thinking
            ids, mask = tokenize_conversation(tokenizer, messages, think, max_length)
        if sum(mask[:-1]) == 0:
            skipped += 1
            continue
        # compact: 4 + 1 bytes per token (Python lists cost ~40), for datasets of many long samples
        samples.append({"id": row_id(row, i), "input_ids": array("i", ids), "loss_mask": array("b", mask)})
    if not samples:
        raise DFlashError(f"{path}: no usable training rows ({skipped} skipped)")
    return samples


def prompt_of(sample: dict) -> list[int]:
    """The prompt of a tokenised sample: its tokens before the first supervised one (held-out evaluation)."""
    mask = sample["loss_mask"]
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    return list(sample["input_ids"][:first])


def load_eval_prompts(path, tokenizer=None, enable_thinking: bool | None = None) -> list[list[int]]:
    """Held-out prompts as token ids: chat/prompt rows through the chat template with the generation prompt,
    tokenised rows up to their first supervised token."""
    prompts = []
    for i, row in read_rows(path):
        if row.get("status", "ok") != "ok":
            continue
        if "input_ids" in row:
            prompts.append(prompt_of({"input_ids": row["input_ids"],
                                      "loss_mask": row.get("loss_mask") or [False] * len(row["input_ids"])}))
            continue
        if tokenizer is None:
            raise DFlashError(f"{path}:{i + 1}: chat rows need the target's tokenizer")
        messages = prompt_messages(row_messages(row, f"{path}:{i + 1}"))
        text = _render(tokenizer, messages, True, row.get("thinking", enable_thinking))
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
