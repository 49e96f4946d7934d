"""python -m dflash.bench draft-vocab: the vocabularies ranked from the answers (their coverage of the answer tokens),
one row per size beside the full vocabulary, the same greedy tokens under every size, the report on stdout and in
--out, and its one-line errors."""

import json

import pytest

pytest.importorskip("torch")

from dflash import cli
from dflash.bench import draftvocab
from dflash.core.draft_vocab import count_answer_tokens
from dflash.core.model_files.tokenizer import load_tokenizer
from dflash.core.training.datasets import load_samples


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_vocab")
    answers = root / "answers.jsonl"
    answers.write_text("".join(json.dumps({"id": f"a{i}", "status": "ok", "messages": [
        {"role": "user", "content": f"def f{i}(x):"},
        {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}"}]}) + "\n" for i in range(6)))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("import os", "class A:", "def g(y):")))
    return answers, prompts


def test_rows_per_size_rank_the_answer_tokens(files, tiny_target_dir, random_draft_dir, tmp_path, capsys):
    import torch

    answers, prompts = files
    distinct = len(count_answer_tokens(load_samples(answers, load_tokenizer(tiny_target_dir))))
    out = tmp_path / "report.json"
    threads = torch.get_num_threads()
    try:
        code = draftvocab.main(["--model", str(tiny_target_dir), "--draft", str(random_draft_dir),
                                "--answers", str(answers), "--prompts", str(prompts), "--sizes", "2", str(distinct),
                                "--num-prompts", "2", "--max-new-tokens", "6", "--timing-rounds", "1",
                                "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["prompts"] == 2 and report["distinct_answer_tokens"] == distinct
    rows = {r["draft_vocab"]: r for r in report["rows"]}
    assert list(rows) == ["full", 2, distinct]
    assert rows["full"]["answer_token_coverage"] == 1.0 and rows[distinct]["answer_token_coverage"] == 1.0
    assert 0 < rows[2]["answer_token_coverage"] < 1  # the two most frequent answer tokens, not all of them
    for r in rows.values():
        assert r["cycles"] > 0 and 1 <= r["tau"] <= 16 and r["draft_forward_relative_to_full"] > 0
    assert rows["full"]["draft_forward_relative_to_full"] == 1.0


def test_one_line_errors(files, capsys):
    answers, _ = files
    args = ["--model", "m", "--draft", "d", "--answers", str(answers)]
    assert cli.run(draftvocab.main, [*args, "--sizes", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: draft-vocab: --sizes") and err.count("\n") == 1
