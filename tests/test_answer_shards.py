"""Answer shards (dflash/core/training/answer_shards.py): round trip, reading from a row on, gaps and a changed
manifest refused."""

import numpy as np
import pytest

from dflash.core.errors import DFlashError
from dflash.core.training.answer_shards import (AnswerRow, count, read_rows, shard_paths, training_samples,
                                                write_manifest, write_shard)


def _rows(n, base=0):
    return [AnswerRow(list(range(base + i, base + i + 10)), 6, i % 2 == 1, i % 3 != 0, i % 2) for i in range(n)]


def test_round_trip_in_order_and_from_a_row_on(tmp_path):
    first, second = _rows(3), _rows(2, base=100)
    write_shard(tmp_path, 0, first, vocab_size=50_000)
    write_shard(tmp_path, 1, second, vocab_size=50_000)
    assert list(read_rows(tmp_path)) == first + second
    assert list(read_rows(tmp_path, start=2, stop=4)) == first[2:] + second[:1]
    assert count(tmp_path) == {"shards": 2, "answers": 5, "answer_tokens": 5 * 4}
    with np.load(shard_paths(tmp_path)[0]) as z:
        assert z["tokens"].dtype == np.uint16  # 2 bytes a token below 65536 ids
    samples = training_samples(tmp_path, start=3)
    assert [s["id"] for s in samples] == ["answers/3", "answers/4"]
    assert list(samples[0]["input_ids"]) == second[0].ids and list(samples[0]["loss_mask"]) == [0] * 6 + [1] * 4


def test_large_vocabularies_keep_their_ids(tmp_path):
    row = AnswerRow([70_000, 1, 151_000], 1, False, True, 0)
    write_shard(tmp_path, 0, [row], vocab_size=152_000)
    assert list(read_rows(tmp_path)) == [row]


def test_a_gap_in_the_numbers_is_refused(tmp_path):
    write_shard(tmp_path, 0, _rows(1), vocab_size=100)
    write_shard(tmp_path, 2, _rows(1), vocab_size=100)
    with pytest.raises(DFlashError, match="answers-00001.npz"):
        shard_paths(tmp_path)


def test_a_directory_keeps_its_model_and_system_turns(tmp_path):
    write_manifest(tmp_path, {"model": "a", "systems": [None]})
    write_manifest(tmp_path, {"model": "a", "systems": [None], "lanes": 8})  # other settings may change
    with pytest.raises(DFlashError, match="manifest.json: model"):
        write_manifest(tmp_path, {"model": "b", "systems": [None]})
