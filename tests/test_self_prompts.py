"""Self-written prompts (backends/torch/self_prompts.py): the user-turn prefix, the benchmark filter, determinism and
resumption on a tiny ChatML target."""

import json

import pytest
from transformers import AutoTokenizer

pytest.importorskip("torch")
from dflash.backends.torch.self_prompts import excluded_prompts, user_turn_prefix, write_self_prompts
from dflash.core.errors import DFlashError


def test_user_turn_prefix_ends_where_the_user_speaks(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert full.startswith(prefix) and full[len(prefix):].startswith("Hello there")
    steered = user_turn_prefix(tok, system="You write Python.")
    assert "You write Python." in steered and steered.rstrip().endswith(prefix.rstrip()[-len("user"):])


def test_benchmark_prompts_and_their_long_runs_are_excluded(tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": "Explain, in simple words, why the sky looks blue on a clear day."}) + "\n")
    texts, runs = excluded_prompts([bench])
    assert "explain in simple words why the sky looks blue on a clear day" in texts
    assert ("why", "the", "sky", "looks", "blue", "on", "a", "clear") in runs


def _run(model, out, n, **kw):
    return write_self_prompts(model, out, num_prompts=n, batch_size=8, max_tokens=48, min_chars=1, seed=3,
                              device="cpu", progress=False, log=lambda m: None, **kw)


def test_seeded_resumable_and_distinct(tiny_target_dir, tmp_path):
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    stats = _run(tiny_target_dir, whole, 6)
    assert stats["total"] == 6
    _run(tiny_target_dir, parts, 3)
    assert _run(tiny_target_dir, parts, 6)["written"] == 3  # the rerun continues the same seeded sequence
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert parts.read_text() == whole.read_text()
    assert [r["id"] for r in rows] == [f"self/{i}" for i in range(6)]
    assert len({r["prompt"] for r in rows}) == 6
    assert _run(tiny_target_dir, whole, 6)["written"] == 0  # nothing left to do


def test_gives_up_in_one_line_when_turns_never_end(tiny_target_dir, tmp_path):
    with pytest.raises(DFlashError, match="distinct prompts after"):
        _run(tiny_target_dir, tmp_path / "p.jsonl", 4, temperature=1e-4)  # near-greedy: one prompt at most
