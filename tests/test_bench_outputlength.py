"""python -m dflash.bench output-length: every method decodes every length exactly (EOS ignored), capped to the
target's context, and the report holds one row per (method, length)."""

import json

import pytest

from dflash.bench.outputlength import main
from dflash.core.errors import DFlashError


def test_output_length_report(tiny_target_dir, random_draft_dir, tmp_path, capsys):
    out = tmp_path / "ol"
    assert main(["--backend", "torch", "--model", str(tiny_target_dir), "--draft", str(random_draft_dir),
                 "--methods", "plain,chain", "--lengths", "24", "8", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["methods"] == ["plain", "chain"] and report["lengths"] == [8, 24]
    for m in ("plain", "chain"):
        rows = [report["rows"][f"{m}:{n}"] for n in (8, 24)]
        assert [r["new_tokens"] for r in rows] == [8, 24]
        assert rows[0]["vs_first"] == 1.0 and all(len(r["runs"]) == 2 and r["tokens_per_second"] > 0 for r in rows)
    assert "| 24 |" in (out / "results.md").read_text() and "| 24 |" in capsys.readouterr().out


def test_unknown_method_is_one_line():
    with pytest.raises(DFlashError, match="--methods"):
        main(["--methods", "plain,fast"])
