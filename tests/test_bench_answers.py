"""python -m dflash.bench answers (dflash/bench/answers.py) at a toy size: every method measured, one JSON object."""

import json

import pytest

pytest.importorskip("torch")
from dflash.bench import main


def test_lanes_and_generate_side_by_side(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "answers.json"
    assert main(["answers", "--model", str(tiny_target_dir), "--lanes", "4", "--max-answer-tokens", "8",
                 "--rounds", "1", "--dtype", "float32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert {"generate", "generate_static", "lanes"} <= set(result["tokens_per_s"])
    assert result["tokens_per_s"]["generate"] > 0 and len(result["rounds"]["lanes"]) == 2
    assert result["lanes_vs_generate"] == round(result["tokens_per_s"]["lanes"] / result["tokens_per_s"]["generate"], 2)
