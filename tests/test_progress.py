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
