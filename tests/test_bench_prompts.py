"""The bundled chat prompt sets: a benchmark split and a training split that share no prompt and no passage, each
covering every category; `--prompts chat` reads the benchmark split as chat messages."""

from __future__ import annotations

import json
from collections import Counter

from dflash.bench.prompts import CHAT_FILE, CHAT_TRAIN_FILE, load_prompts, prompt_rows

CATEGORIES = {"explanation", "how-to", "code", "arithmetic", "list", "json", "rewrite", "summarize"}


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def passage(prompt: str) -> str | None:
    """The passage a rewrite / summarize prompt quotes (after the instruction's blank line)."""
    return prompt.split("\n\n", 1)[1] if "\n\n" in prompt else None


def test_splits_are_disjoint_and_cover_every_category():
    bench, train = rows(CHAT_FILE), rows(CHAT_TRAIN_FILE)
    assert len(bench) >= 64 and len(train) >= 200
    for split in (bench, train):
        assert all(set(r) == {"id", "category", "prompt"} and r["prompt"].strip() for r in split)
        assert len({r["id"] for r in split}) == len(split) and len({r["prompt"] for r in split}) == len(split)
        counts = Counter(r["category"] for r in split)
        assert set(counts) == CATEGORIES and min(counts.values()) >= len(split) // len(CATEGORIES) - 1
    assert not {r["prompt"] for r in bench} & {r["prompt"] for r in train}
    quoted = {split: {passage(r["prompt"]) for r in rs if r["category"] in ("rewrite", "summarize")}
              for split, rs in (("bench", bench), ("train", train))}
    assert None not in quoted["bench"] | quoted["train"] and not quoted["bench"] & quoted["train"]
    assert {r["category"] for r in bench[:len(CATEGORIES)]} == CATEGORIES  # --num-prompts 8 samples them all


def test_prompts_chat_goes_through_the_chat_template(tiny_target_dir):
    from transformers import AutoTokenizer

    listed = prompt_rows("chat")
    assert len(listed) == len(rows(CHAT_FILE)) and all(r["messages"][0]["role"] == "user" for r in listed)
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))  # ChatML
    prompts, skipped = load_prompts(["chat"], tok, 3, chat=False, max_context=None, max_new_tokens=8)
    assert not skipped and len(prompts) == 3
    assert tok.decode(prompts[0]["ids"]).startswith("<|im_start|>user\n")
