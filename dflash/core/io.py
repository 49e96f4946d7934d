"""Atomic file writes (a reader never sees a half-written checkpoint, log or JSONL file), config reads that fail
with one line, and where the project's own cache lives."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import DFlashError


def cache_root() -> Path:
    """$DFLASH_CACHE_DIR, default ~/.cache/dflash: prepared models (models/) and the bundled pair's AR draft when
    built rather than packaged (reference/). The one place the variable is read."""
    return Path(os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash")


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; done once, at import
    os.umask(mask)
    return mask


# mkstemp / mkdtemp create 0600 / 0700: a finished file or directory gets the mode open() / mkdir() would give it
_UMASK = _umask()
_FILE_MODE, _DIR_MODE = 0o666 & ~_UMASK, 0o777 & ~_UMASK


def read_json_config(path: Path, missing: str):
    """A config.json's parsed content; one line naming the file when it is missing (`missing` says what the
    directory needs), unreadable or not JSON."""
    if not path.is_file():
        raise DFlashError(f"{path}: missing; {missing}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise DFlashError(f"{path}: cannot read ({e.strerror})") from None


def check_output_dir(directory: str | os.PathLike, flag: str = "--out", output: str | os.PathLike | None = None) \
        -> Path:
    """Fail fast, creating nothing: `directory` exists as a writable directory, or can be created (its nearest
    existing ancestor is a writable directory). Run before slow work so a bad path costs nothing and leaves
    nothing behind. `output`: the file the message names (default: the directory)."""
    directory = Path(directory)
    shown = output if output is not None else directory
    probe = directory
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise DFlashError(f"{flag}: cannot create {shown}: {probe} is a file, expected a directory")
    if not os.access(probe, os.W_OK):
        raise DFlashError(f"{flag}: cannot create {shown}: {probe} is not writable")
    return directory


def _check_writable(directory: Path) -> None:
    check_output_dir(directory, "output")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"{directory}: cannot create output directory ({e.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise DFlashError(f"{directory}: output directory is not writable")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; rename it over `path` only if the block finishes."""
    path = Path(path)
    _check_writable(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _plain_modes(directory: Path) -> None:
    """The modes a plain mkdir / open would give (mkdtemp makes 0700, safetensors writes 0600): a model directory in
    a shared cache is readable by the others who use it."""
    directory.chmod(_DIR_MODE)
    for f in directory.rglob("*"):
        f.chmod(_DIR_MODE if f.is_dir() else _FILE_MODE)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike):
    """Build a whole directory under a temporary name, then swap it into place."""
    path = Path(path)
    _check_writable(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _plain_modes(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
