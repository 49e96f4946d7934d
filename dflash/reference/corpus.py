"""The reference corpus: Python source of the running interpreter's standard library, split by file.

A file is held out when a hash of its path relative to the stdlib root falls in the held-out bucket, so the split
depends on nothing but the path (not on the order files are listed in, nor on which other files exist). Held-out
files are never trained on: the target's pretraining text, the drafter's training prompts and the tokenizer all come
from train files only; the bundled benchmark prompts come from held-out files only.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Tests, IDLE, third-party packages, codec tables and the pydoc topic dump are not the Python we want to imitate.
EXCLUDE = ("test", "tests", "idlelib", "site-packages", "dist-packages", "encodings", "pydoc_data", "lib2to3",
           "__phello__", "turtledemo")
HELDOUT_PER_MILLE = 100  # ~10% of files
MAX_FILE_BYTES = 400_000  # skip generated giants


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, '/'-separated
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.path)


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.replace("\\", "/").encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELDOUT_PER_MILLE


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | Path | None = None, limit_bytes: int | None = None) -> list[SourceFile]:
    """Every usable .py file under the stdlib root, sorted by relative path. `limit_bytes` keeps a deterministic
    subset (files in hash order until the budget is met) for the fast build."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(part in EXCLUDE for part in rel.split("/")):
            continue
        try:
            if p.stat().st_size > MAX_FILE_BYTES:
                continue
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(SourceFile(rel, text.replace("\r\n", "\n")))
    if limit_bytes is not None:
        keyed = sorted(out, key=lambda f: hashlib.sha256(f.path.encode()).hexdigest())
        kept, total = set(), 0
        for f in keyed:
            # keep filling each side of the split so the fast corpus has both train and held-out files
            kept.add(f.path)
            total += len(f.text)
            if total >= limit_bytes and any(is_heldout(p) for p in kept) and any(not is_heldout(p) for p in kept):
                break
        out = [f for f in out if f.path in kept]
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """-> (train, held-out)."""
    return [f for f in files if not f.heldout], [f for f in files if f.heldout]
