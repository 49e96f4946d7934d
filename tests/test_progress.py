"""Long waits say what runs: a heartbeat line every few seconds (dflash/core/progress.py), here for a long prompt's
prefill (the device profile's is in tests/test_costs.py)."""

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
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.002)
    with progress.Heartbeat("loading"):
        time.sleep(0.02)
        with progress.Heartbeat("measuring") as inner:
            progress.note("a plain step")
            time.sleep(0.02)
        assert progress.Heartbeat.now is not inner
        progress.note("the tokenizer")
        time.sleep(0.02)
    assert progress.Heartbeat.now is None
    lines = capsys.readouterr().err.splitlines()
    measuring = [i for i, line in enumerate(lines) if line.startswith("dflash: still measuring")]
    assert measuring and all(lines[i].endswith(": a plain step") for i in measuring)
    assert lines[0].startswith("dflash: still loading, ") and lines[-1].endswith(": the tokenizer")
    # the outer one is quiet while the inner one runs (a line it began as the inner one started may land after it)
    assert not any(line.startswith("dflash: still loading") for line in lines[measuring[0] + 2:measuring[-1]])
