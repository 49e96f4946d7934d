"""Training data (backends/torch/training/data.py): an answers shard directory as --data, a row range of it, and
evaluations at the steps --eval-at names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dflash.backends.torch.training import TrainConfig, train
from dflash.backends.torch.training.data import load_samples, row_range
from dflash.core.errors import DFlashError
from dflash.core.training.answer_shards import AnswerRow, write_shard


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    d = tmp_path_factory.mktemp("answers")
    rows = [AnswerRow(torch.randint(3, 500, (30,), generator=g).tolist(), 8, False, True, 0) for _ in range(10)]
    write_shard(d, 0, rows[:6], vocab_size=512)
    write_shard(d, 1, rows[6:], vocab_size=512)
    return d, rows


def _cfg(target, data, out, **extra) -> TrainConfig:
    return TrainConfig(**dict(target=str(target), data=str(data), out=str(out), num_layers=1, block_size=4,
                              num_anchors=4, max_steps=3, save_every=0, progress=False, plot=False, device="cpu",
                              eval_max_prompts=2, eval_max_new_tokens=4, eval_at_end=False, quiet=True) | extra)


def test_a_row_range_of_an_answers_directory(shards, tmp_path):
    d, rows = shards
    samples = load_samples(_cfg("t", d, tmp_path, data_rows="4:8"), tokenizer=None)
    assert [list(s["input_ids"]) for s in samples] == [r.ids for r in rows[4:8]]  # across the shard boundary
    assert list(samples[0]["loss_mask"]) == [0] * 8 + [1] * 22
    assert row_range("5:") == (5, None) and row_range(None) == (0, None)
    with pytest.raises(DFlashError, match="--data-rows: got 'x'"):
        row_range("x")
    with pytest.raises(DFlashError, match="no answers in rows 20:30"):
        load_samples(_cfg("t", d, tmp_path, data_rows="20:30"), tokenizer=None)


def test_trains_on_shards_and_evaluates_at_the_named_steps(tiny_target_dir, shards, tmp_path):
    d, _ = shards
    result = train(_cfg(tiny_target_dir, d, tmp_path / "run", data_rows="0:8", eval_holdout=2, eval_at=[1, 2]))
    assert result.steps == 3 and [e["step"] for e in result.evals] == [1, 2]
