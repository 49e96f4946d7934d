"""dflash/core/costs.py: the device profile of --verify auto, measured through the engine and cached per shape."""

import json

import torch

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.drafter import load_drafter
from dflash.backends.torch.target import load_target
from dflash.core import costs


def test_measured_once_then_read_from_the_cache(tiny_target_dir, random_draft_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "NOTICE_SECONDS", 0.0)
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    backend = torch_engine(model, load_drafter(random_draft_dir), block_size=8)
    first = costs.measured_costs(backend, max_tokens=17)
    assert "measured this device's draft and verify costs" in capsys.readouterr().err
    ns = [n for n, _ in first.verify]
    assert ns[0] == 1 and ns == sorted(ns) and first.draft > 0
    assert all(a[1] <= b[1] for a, b in zip(first.verify, first.verify[1:]))  # monotone
    assert sorted(first.batch) == list(costs.BATCH_ROWS) and sorted(first.draft_batch) == list(costs.BATCH_ROWS)
    assert [n for n, _ in first.batch[4]] == [1, 2, 4, 8]  # tokens per row up to the block
    # shorter drafts at every measured row count; the whole block's are the draft points above
    assert sorted(first.draft_blocks) == [2, 4, 8] and first.draft_blocks[8] == {1: first.draft, **first.draft_batch}
    assert all(sorted(points) == [1, *costs.BATCH_ROWS] for points in first.draft_blocks.values())
    assert backend.rows == [] and backend.pending is None  # the engine is left empty
    (path,) = (tmp_path / "costs").glob("*.json")
    assert "torch" in json.loads(path.read_text())["device"]

    calls = []
    monkeypatch.setattr(costs, "measure", lambda *a, **k: calls.append(1))
    again = costs.measured_costs(backend, max_tokens=17)
    assert again == first and not calls and capsys.readouterr().err == ""
    other = torch_engine(model, load_drafter(random_draft_dir), block_size=16)  # another shape: its own entry
    assert costs.cost_key(other) != costs.cost_key(backend)


def test_a_damaged_cache_file_is_measured_again(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    backend = torch_engine(load_target(tiny_target_dir, torch.float32, "cpu"))
    path = costs.cache_dir() / f"{costs.cost_key(backend)}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    measured = costs.measured_costs(backend, max_tokens=3)
    assert measured.verify[0][0] == 1 and json.loads(path.read_text())["verify_seconds"]
