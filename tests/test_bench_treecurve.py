"""python -m dflash.bench tree-curve: every row lossless, the report files written."""

import json

from dflash.bench.treecurve import main


def test_tree_curve_on_the_trained_pair(trained_pair, tmp_path, capsys):
    target_dir, draft_dir = trained_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "class A:", "import os"]))
    out = tmp_path / "curve"
    assert main(["--backend", "torch", "--model", str(target_dir), "--draft", str(draft_dir), "--prompts",
                 str(prompts), "--num-prompts", "3", "--max-new-tokens", "32", "--budgets", "2", "8",
                 "--chains", "3", "16", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["kind"], r["budget"]) for r in report["rows"]] == [("chain", 2), ("chain", 15), ("tree", 2),
                                                                  ("tree", 8)]
    assert all(r["lossless"] for r in report["rows"])
    assert report["rows"][2]["verified_per_cycle"] <= 2
    assert out.with_suffix(".png").stat().st_size > 0 and "| tree, 8 nodes |" in capsys.readouterr().out
