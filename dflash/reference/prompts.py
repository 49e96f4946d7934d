"""Completion prompts cut from the corpus: function signatures, signature + docstring, and partial bodies.

Every function (or method, dedented) of a file gives up to three prompts:
  signature   the `def` header, ending at its colon            def add(a, b):
  docstring   the header and the docstring                     def add(a, b):\n    \"\"\"Sum.\"\"\"
  partial     the header and the first half of the body        def add(a, b):\n    c = a + b
A prompt never ends in a newline: the indentation of the next line belongs to the completion, exactly as the
tokenizer saw it during pretraining (byte-level BPE merges a newline with the indentation after it).

Training prompts come from train files; the bundled benchmark prompts (prompts.jsonl) from held-out files, and only
those that occur nowhere in the training text.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

from .corpus import SourceFile

KINDS = ("signature", "docstring", "partial")
BENCHMARK_FILE = Path(__file__).with_name("prompts.jsonl")


@dataclass
class Function:
    source: str  # dedented, from the `def` line (decorators excluded) to the end of the body
    header_lines: int  # lines of the `def` header (a signature may span lines)
    doc_lines: int  # lines of the docstring right after the header (0 if none)
    body_lines: int  # lines after the header
    name: str
    path: str


@dataclass
class Prompt:
    prompt: str
    kind: str
    path: str
    name: str

    def to_json(self) -> dict:
        return asdict(self)


def functions(file: SourceFile, min_body_lines: int = 2, max_lines: int = 80) -> list[Function]:
    """The functions of a file that make sensible prompts (short enough to complete, long enough to matter)."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    lines = file.text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        start, end = node.lineno - 1, node.end_lineno  # the `def` line .. last body line (0-based, exclusive)
        body_start = node.body[0].lineno - 1
        decorated = node.body[0]
        if isinstance(decorated, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and decorated.decorator_list:
            body_start = min(d.lineno for d in decorated.decorator_list) - 1
        header = body_start - start
        if header < 1 or end - start > max_lines or end - body_start < min_body_lines:
            continue  # one-line `def f(): pass`, giants, trivial bodies
        text = "\n".join(lines[start:end])
        if "\t" in text:
            continue
        src = textwrap.dedent(text)
        first = node.body[0]
        doc = 0
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            doc = (first.end_lineno or first.lineno) - first.lineno + 1
        out.append(Function(src, header, doc, end - body_start, node.name, file.path))
    return out


def cut(fn: Function, kind: str) -> str | None:
    """The prompt of one kind for a function, or None if the function has no such prompt."""
    lines = fn.source.split("\n")
    if kind == "signature":
        n = fn.header_lines
    elif kind == "docstring":
        if not fn.doc_lines:
            return None
        n = fn.header_lines + fn.doc_lines
    elif kind == "partial":
        body = fn.body_lines - fn.doc_lines
        if body < 2:
            return None
        n = fn.header_lines + fn.doc_lines + body // 2
    else:
        raise ValueError(f"unknown prompt kind {kind!r}")
    text = "\n".join(lines[:n]).rstrip()
    return text if text.strip() else None


def all_prompts(files: list[SourceFile]) -> list[Prompt]:
    out = []
    for f in files:
        for fn in functions(f):
            for kind in KINDS:
                p = cut(fn, kind)
                if p is not None:
                    out.append(Prompt(p, kind, fn.path, fn.name))
    return out


def _order_key(p: Prompt, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{p.path}:{p.name}:{p.kind}:{p.prompt}".encode()).hexdigest()


def training_prompts(train_files: list[SourceFile], limit: int | None = None, seed: int = 0,
                     max_chars: int = 1500) -> list[Prompt]:
    """Prompts from train files, deduplicated, in a seeded order that does not depend on file listing order."""
    seen, out = set(), []
    for p in sorted(all_prompts(train_files), key=lambda p: _order_key(p, seed)):
        if p.prompt in seen or len(p.prompt) > max_chars:
            continue
        seen.add(p.prompt)
        out.append(p)
    return out[:limit] if limit is not None else out


def benchmark_prompts(heldout_files: list[SourceFile], training_texts: list[str], n: int = 32, seed: int = 0,
                      min_chars: int = 24, max_chars: int = 1200) -> list[Prompt]:
    """n prompts from held-out files, balanced over kinds, at most two per file, none occurring in any training
    text (a signature like `def __init__(self):` would, and is dropped)."""
    by_kind: dict[str, list[Prompt]] = {k: [] for k in KINDS}
    for p in sorted(all_prompts(heldout_files), key=lambda p: _order_key(p, seed)):
        if min_chars <= len(p.prompt) <= max_chars:
            by_kind[p.kind].append(p)
    out: list[Prompt] = []
    per_file: dict[str, int] = {}
    seen: set = set()
    iters = {k: iter(v) for k, v in by_kind.items()}
    while len(out) < n and iters:
        for kind in list(iters):
            for p in iters[kind]:
                if p.prompt in seen or per_file.get(p.path, 0) >= 2:
                    continue
                if any(p.prompt in t for t in training_texts):
                    continue
                seen.add(p.prompt)
                per_file[p.path] = per_file.get(p.path, 0) + 1
                out.append(p)
                break
            else:
                del iters[kind]
            if len(out) >= n:
                break
    return out


def chat_example(fn: Function, kind: str) -> tuple[str, str] | None:
    """(user, assistant) for the chat part of pretraining: a prompt in, the whole function out."""
    p = cut(fn, kind)
    return None if p is None else (p, fn.source.rstrip())


def write_jsonl(prompts: list[Prompt], path: str | Path) -> None:
    from dflash.core.io import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(p.to_json()) + "\n" for p in prompts))


def read_jsonl(path: str | Path = BENCHMARK_FILE) -> list[Prompt]:
    with open(path) as f:
        return [Prompt(**json.loads(line)) for line in f if line.strip()]


def benchmark() -> list[Prompt]:
    """The bundled reference benchmark prompts (from held-out files)."""
    return read_jsonl(BENCHMARK_FILE)


def shuffled(prompts: list[Prompt], seed: int) -> list[Prompt]:
    out = list(prompts)
    random.Random(seed).shuffle(out)
    return out
