"""Long waits say what runs: a heartbeat line every few seconds (dflash/core/progress.py), here for a long prompt's
prefill."""

from __future__ import annotations

import time

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.backend import torch_engine  # noqa: E402
from dflash.backends.torch.drafter import load_drafter  # noqa: E402
from dflash.backends.torch.target import load_target  # noqa: E402
from dflash.core import loop, progress  # noqa: E402


def test_a_long_prefill_says_so_and_a_short_one_is_quiet(tiny_target_dir, random_draft_dir, monkeypatch, capsys):
    engine = torch_engine(load_target(tiny_target_dir, torch.float32, "cpu"), load_drafter(random_draft_dir),
                          block_size=4)
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.001)
    monkeypatch.setattr(loop, "LONG_PROMPT", 8)
    prefill = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda *a, **k: (time.sleep(0.05), prefill(*a, **k))[1])
    loop.generate(engine, list(range(5, 15)), max_new_tokens=2)
    beats = capsys.readouterr().err.splitlines()
    assert beats and all(line.startswith("dflash: still prefilling the prompt's 10 tokens, ") for line in beats)
    loop.generate(engine, list(range(5, 12)), max_new_tokens=2)  # 7 tokens: under LONG_PROMPT, no heartbeat
    assert capsys.readouterr().err == ""
    assert progress.Heartbeat.now is None


def test_heartbeats_nest_and_only_the_innermost_speaks(monkeypatch, capsys):
    # (the lines are asked for directly: a thread's timing on a loaded machine decides nothing here)
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 3600.0)
    with progress.Heartbeat("loading") as outer:
        outer.speak()
        with progress.Heartbeat("measuring") as inner:
            progress.note("a plain step")
            outer.speak()
            inner.speak()
        assert progress.Heartbeat.now is outer
        inner.speak()  # (finished: quiet)
        progress.note("the tokenizer")
        outer.speak()
    assert progress.Heartbeat.now is None
    lines = [line.split(", ")[0] + line[line.index(" so far"):] for line in capsys.readouterr().err.splitlines()]
    assert lines == ["dflash: still loading so far", "dflash: still measuring so far: a plain step",
                     "dflash: still loading so far: the tokenizer"]


def test_a_heartbeat_speaks_on_its_own_every_few_seconds(monkeypatch, capsys):
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.001)
    err = ""
    with progress.Heartbeat("loading"):
        progress.note("weights")
        deadline = time.perf_counter() + 30  # (its thread speaks within a millisecond on a quiet machine)
        while (err.count("\n") < 2 or not err.endswith(": weights\n")) and time.perf_counter() < deadline:
            time.sleep(0.01)
            err += capsys.readouterr().err
    lines = err.splitlines()  # (a line may come before the note: the thread starts with the heartbeat)
    assert len(lines) >= 2 and all(line.startswith("dflash: still loading, ") for line in lines)
    assert lines[-1].endswith(": weights")
