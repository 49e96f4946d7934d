"""Atomic writes: a finished file or directory gets the permissions a plain open() / mkdir() would give it (the
temporary one mkstemp / mkdtemp creates is private)."""

from __future__ import annotations

import os
import stat

from dflash.core.io import atomic_directory, atomic_write_text


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_get_the_modes_of_plain_writes(tmp_path):
    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "plain_dir").mkdir()
    atomic_write_text(tmp_path / "atomic.txt", "x")
    with atomic_directory(tmp_path / "atomic_dir") as d:
        (d / "inside.json").write_text("{}")
    assert mode(tmp_path / "atomic.txt") == mode(tmp_path / "plain.txt")
    assert mode(tmp_path / "atomic_dir") == mode(tmp_path / "plain_dir")
