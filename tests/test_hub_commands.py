"""Every `hf download` line dflash prints (README, `python -m dflash.models`, the not-in-the-cache error) run through
the real `hf` CLI of the installed huggingface_hub with the download mocked: each must fetch exactly the files
hub.resolve fetches, with no warning (a pattern that `hf` reads as a file name drops every `--include`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

from dflash import hub

ROOT = Path(__file__).resolve().parents[1]


def hf_download_call(command: str) -> dict:
    """The snapshot_download arguments the `hf` CLI derives from `command` (warnings raised as errors)."""
    from huggingface_hub.cli import download, hf

    args = shlex.split(command)
    assert args[:2] == ["hf", "download"], command
    calls = []

    def snapshot_download(**kwargs):
        calls.append(kwargs)
        return "/nowhere"

    def hf_hub_download(**kwargs):
        raise AssertionError(f"{command!r} fetches a single file: {kwargs['filename']}")

    with mock.patch.object(download, "snapshot_download", snapshot_download), \
            mock.patch.object(download, "hf_hub_download", hf_hub_download), warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.app.main(args[1:], prog_name="hf", standalone_mode=False)
    assert len(calls) == 1, command
    return calls[0]


def assert_fetches_what_resolve_fetches(command: str, repo_id: str) -> None:
    call = hf_download_call(command)
    assert call["repo_id"] == repo_id and call["repo_type"] == "model"
    assert call["allow_patterns"] == hub.ALLOW_PATTERNS, command
    assert call["ignore_patterns"] is None and call["local_dir"] is None  # into the standard HF cache


def test_a_pattern_after_include_is_a_file_name():
    """Why the lines look as they do: the pre-1.0 form drops --include under huggingface_hub >= 1.0."""
    with pytest.raises(UserWarning, match="Ignoring `--include`"):
        hf_download_call("hf download Qwen/Qwen3-8B --include '*.json' '*.safetensors'")


@pytest.mark.parametrize("repo_id", sorted({p.target for p in hub.PAIRS if p.target not in hub.PREPARED} |
                                            {p.draft for p in hub.PAIRS if p.draft}))
def test_download_command(repo_id):
    assert_fetches_what_resolve_fetches(hub.download_command(repo_id), repo_id)


def test_readme_commands():
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith("hf download ")]
    assert len(lines) >= 2
    for line in lines:
        assert_fetches_what_resolve_fetches(line, shlex.split(line)[2])


def test_models_prints_working_commands(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    from dflash import models

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert models.main([]) == 0
    lines = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("hf download")]
    assert [shlex.split(ln)[2] for ln in lines] == [hub.PAIRS[1].target, hub.PAIRS[1].draft]
    for line in lines:
        assert_fetches_what_resolve_fetches(line, shlex.split(line)[2])


def test_not_cached_hint_is_a_working_command(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "dflash.generate", "--model", "org/absent", "--prompt", "x"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    command = re.search(r"fetch it with: (hf download .*)$", p.stderr.strip()).group(1)
    assert_fetches_what_resolve_fetches(command, "org/absent")


def test_resolve_pair_without_a_drafter_ignores_draft(tmp_path):
    """--no-draft wins over --draft, with the bundled pair as with a local model (the drafter is never resolved)."""
    from dflash.reference import reference_dirs

    target, draft = reference_dirs()
    assert hub.resolve_pair(None, str(tmp_path / "missing"), want_draft=False) == (target, None)
    assert hub.resolve_pair(None, None) == (target, draft)
    assert hub.resolve_pair(str(target), str(draft)) == (target, draft)
    assert hub.resolve_pair(str(target), str(tmp_path / "missing"), want_draft=False) == (target, None)
