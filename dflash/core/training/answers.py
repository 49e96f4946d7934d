"""The regenerated-answers JSONL both regeneration paths write (in-process: backends/torch/regeneration.py; through
an OpenAI-compatible server: dflash/remote_regeneration.py): crash-safe appends, recovery of a torn last line, and
the status counts."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TextIO

from .datasets import read_rows, row_id
from ..io import atomic_write_text


def recover_output(path: Path) -> set[str]:
    """Ids already written; a torn last line (no trailing newline, or not JSON) is truncated away."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a partial write
    lines = data[:keep].splitlines()
    done, good = set(), 0
    for line in lines:
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a garbled line can only be the torn end of an older crash: drop it and what follows
        good += len(line) + 1
    if good != len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return done


def append_row(f, row: dict) -> None:
    """One row, flushed and fsynced: a crash after this line returns loses nothing."""
    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


class AnswerFile:
    """The output JSONL, opened for appending with its first row: a run stopped before any answer was finished
    leaves no empty file behind."""

    def __init__(self, path: Path):
        self.path = path
        self.file: TextIO | None = None

    def append(self, row: dict) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")
        append_row(self.file, row)

    def ensure(self) -> None:
        """A finished run has its file even with no row to write (an empty input)."""
        self.path.touch()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def output_stats(path: Path) -> dict:
    counts: Counter[str] = Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            counts[json.loads(line).get("status", "ok")] += 1
    return {"ok": counts["ok"], "failed": counts["failed"], "skipped": counts["skipped"], "total": sum(counts.values())}


def write_stats(output_path: Path, input_count: int, log) -> dict:
    """The finished run's counts, next to its output as <name>.stats.json, and one summary line."""
    stats = output_stats(output_path)
    stats["input_rows"] = input_count
    atomic_write_text(output_path.with_name(output_path.name.removesuffix(".jsonl") + ".stats.json"),
                      json.dumps(stats, indent=2) + "\n")
    log(f"regenerate: ok {stats['ok']}, failed {stats['failed']}, skipped {stats['skipped']} -> {output_path}")
    return stats


def input_rows(input_path) -> list[tuple[int, str, dict]]:
    """Every input row with a unique id (a repeated id gets a #k suffix, stable across reruns)."""
    rows: list[tuple[int, str, dict]] = []
    seen: Counter[str] = Counter()
    for i, row in read_rows(input_path):
        rid = row_id(row, i)
        seen[rid] += 1
        if seen[rid] > 1:
            rid = f"{rid}#{seen[rid] - 1}"
        rows.append((i, rid, row))
    return rows
