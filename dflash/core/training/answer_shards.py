"""The target's answers as token ids in numbered shards: compact (2 bytes a token), append-only, crash-safe.

A shard `answers-NNNNN.npz` holds whole conversations (system turn, the request, the assistant header, the answer)
as one flat token array with offsets, and per row where the answer starts, whether it was sampled and whether it
ended on its own. A shard is written whole (a temporary file renamed into place), so a killed writer loses only the
rows of the shard it had not finished; the next run continues at the next shard number. `manifest.json` says which
model wrote them and how. Training reads rows in shard order and can start at any row (`read_rows(start=...)`),
which is how a learning curve trains each point on answers no earlier point saw.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import DFlashError
from ..io import atomic_write_text

SHARD = re.compile(r"answers-(\d{5})\.npz$")


@dataclass
class AnswerRow:
    ids: list[int]  # the whole conversation
    answer_start: int  # ids[answer_start:] is the answer (the tokens a drafter learns to propose)
    sampled: bool  # drawn at a temperature (else greedy)
    finished: bool  # ended on an end-of-turn token (else cut at the length limit)
    system: int  # index of the system turn it was written under (manifest["systems"])


def shard_paths(directory) -> list[Path]:
    """The shards of `directory`, in order; numbers must run 0, 1, 2, ... without a gap."""
    numbered = sorted((int(m.group(1)), p) for p in Path(directory).glob("answers-*.npz")
                      if (m := SHARD.search(p.name)))
    paths = [p for _, p in numbered]
    for i, (number, p) in enumerate(numbered):
        if number != i:
            raise DFlashError(f"{p}: expected answers-{i:05d}.npz (shards are numbered without gaps)")
    return paths


def write_shard(directory, index: int, rows: list[AnswerRow], vocab_size: int) -> Path:
    """Shard `index` with `rows`, written whole (temporary file, then renamed)."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    flat = np.fromiter((t for r in rows for t in r.ids), dtype=dtype)
    offsets = np.cumsum([0] + [len(r.ids) for r in rows], dtype=np.int64)
    path = Path(directory) / f"answers-{index:05d}.npz"
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, tokens=flat, offsets=offsets,
                        answer_start=np.array([r.answer_start for r in rows], dtype=np.int32),
                        sampled=np.array([r.sampled for r in rows], dtype=bool),
                        finished=np.array([r.finished for r in rows], dtype=bool),
                        system=np.array([r.system for r in rows], dtype=np.uint8))
    os.replace(tmp, path)
    return path


def read_shard(path) -> list[AnswerRow]:
    try:
        with np.load(path) as z:
            tokens, offsets = z["tokens"], z["offsets"]
            starts, sampled, finished, system = z["answer_start"], z["sampled"], z["finished"], z["system"]
    except (OSError, KeyError, ValueError) as e:
        raise DFlashError(f"{path}: not an answers shard ({e})") from None
    return [AnswerRow(tokens[offsets[i]:offsets[i + 1]].tolist(), int(starts[i]), bool(sampled[i]),
                      bool(finished[i]), int(system[i])) for i in range(len(starts))]


def read_rows(directory, start: int = 0, stop: int | None = None) -> Iterator[AnswerRow]:
    """Rows start..stop-1 of the shards of `directory`, in order (shards before `start` are not decompressed)."""
    seen = 0
    for path in shard_paths(directory):
        with np.load(path) as z:
            n = len(z["answer_start"])
        if seen + n <= start:
            seen += n
            continue
        for row in read_shard(path):
            if stop is not None and seen >= stop:
                return
            if seen >= start:
                yield row
            seen += 1
        if stop is not None and seen >= stop:
            return


def count(directory) -> dict:
    """Rows and answer tokens in the shards of `directory`."""
    rows = tokens = 0
    for path in shard_paths(directory):
        with np.load(path) as z:
            rows += len(z["answer_start"])
            lengths = np.diff(z["offsets"])
            tokens += int((lengths - z["answer_start"]).sum())
    return {"shards": len(shard_paths(directory)), "answers": rows, "answer_tokens": tokens}


def training_samples(directory, start: int = 0, stop: int | None = None, max_length: int | None = None) -> list:
    """Rows as the trainer's samples ({"id", "input_ids", "loss_mask"}): the loss covers the answer only."""
    samples = []
    for i, row in enumerate(read_rows(directory, start, stop), start):
        ids = row.ids[:max_length] if max_length else row.ids
        if len(ids) - row.answer_start < 2:
            continue
        mask = array("b", [0] * row.answer_start + [1] * (len(ids) - row.answer_start))
        samples.append({"id": f"answers/{i}", "input_ids": array("i", ids), "loss_mask": mask})
    return samples


def read_manifest(directory) -> dict | None:
    path = Path(directory) / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(directory, manifest: dict) -> None:
    """The writer's settings; a directory's later runs must agree on the model and its system turns."""
    old = read_manifest(directory)
    for key in ("model", "systems"):
        if old is not None and old.get(key) != manifest.get(key):
            raise DFlashError(f"{Path(directory) / 'manifest.json'}: {key} {old.get(key)!r} differs from this "
                              f"run's {manifest.get(key)!r}; write to another directory")
    atomic_write_text(Path(directory) / "manifest.json", json.dumps(manifest, indent=1) + "\n")
