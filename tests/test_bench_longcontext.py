"""python -m dflash.bench long-context: prompts near their lengths, every output equal to target-only, the report."""

import json

import pytest

from dflash.bench.longcontext import build_prompts, main
from dflash.core.model_files.tokenizer import load_tokenizer


def test_prompts_fit_their_lengths_and_keep_their_passage(tiny_target_dir):
    tok = load_tokenizer(tiny_target_dir)
    prompts = build_prompts(tok, [64, 200], 2, seed=0)
    assert [(p["length"], p["index"]) for p in prompts] == [(64, 0), (64, 1), (200, 0), (200, 1)]
    assert all(p["length"] - 8 <= len(p["ids"]) <= p["length"] for p in prompts)
    short, long = (tok.decode(p["ids"]) for p in (prompts[0], prompts[2]))
    passage = short.split("\n\n" + prompts[0]["question"])[0]
    assert len(passage) >= 24 and long.startswith(passage)  # the same passage start at every length
    assert prompts[0]["question"] == prompts[2]["question"] and prompts[0]["ids"] != prompts[1]["ids"]
    assert build_prompts(tok, [64], 1, seed=0)[0]["ids"] == prompts[0]["ids"]  # deterministic


def test_long_context_report(tiny_target_dir, random_draft_dir, tmp_path, capsys):
    out = tmp_path / "lc"
    assert main(["--backend", "torch", "--model", str(tiny_target_dir), "--draft", str(random_draft_dir),
                 "--lengths", "64", "128", "--num-prompts", "2", "--max-new-tokens", "16",
                 "--draft-window", "none", "32", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["draft_windows"] == [None, 32] and report["lengths"] == [64, 128]
    assert [(r["draft_window"], r["length"]) for r in report["rows"]] == [(None, 64), (None, 128), (32, 64),
                                                                         (32, 128)]
    for r in report["rows"]:
        assert r["lossless"] and r["identical"] == 2
        assert all(r["length"] - 8 <= n <= r["length"] for n in r["prompt_tokens"])
        assert len(r["per_position"]) == report["block_size"] - 1 == 15
        assert r["cycles"] > 0 and r["tau"] == pytest.approx(1 + sum(r["per_position"]))  # (the same cycles)
    assert len(report["prompts"]) == 4 and all("tokens" in p and "question" in p for p in report["prompts"])
    assert (out / "tau_vs_context.png").stat().st_size > 0 and "window 32" in (out / "results.md").read_text()
    assert "| 128 |" in capsys.readouterr().out


def test_lengths_past_the_context_are_shortened(tiny_target_dir, random_draft_dir, tmp_path, capsys):
    # the tiny target's context is 4096: with 4 new tokens, a prompt of 4096 tokens is shortened to 4092
    from dflash.bench import longcontext

    out = tmp_path / "lc"
    assert longcontext.main(["--backend", "torch", "--model", str(tiny_target_dir), "--draft", str(random_draft_dir),
                             "--lengths", "4096", "--num-prompts", "1", "--max-new-tokens", "4",
                             "--draft-window", "64", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    # (the passage is cut at a word: one word of code can take tens of tokens in the tiny tokenizer)
    assert report["lengths"] == [4092] and 3900 <= report["rows"][0]["prompt_tokens"][0] <= 4092
    assert "shortened to 4092" in capsys.readouterr().err
