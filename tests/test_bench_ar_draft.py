"""python -m dflash.bench ar-draft: the cut (the target's first N layers under its embeddings, norm and head, a plain
transformers directory with the tokenizer and chat template), a few distillation steps, its one-line errors, and the
draft it writes racing in transformers' assisted generation with greedy output equal to the target's."""

import json

import pytest

pytest.importorskip("torch")

from dflash.backends.torch.ar_draft import TAU_DRAFT_LENGTHS, greedy_tau
from dflash.bench import ar_draft
from dflash.core.errors import DFlashError


@pytest.fixture(scope="module")
def target_and_answers(tmp_path_factory):
    from tiny_pair import build_tiny_target

    root = tmp_path_factory.mktemp("ar_draft")
    build_tiny_target(root / "target", seed=0)  # sharp logits: greedy choices with wide margins
    answers = root / "answers.jsonl"
    answers.write_text("".join(json.dumps({"id": f"a{i}", "status": "ok", "messages": [
        {"role": "user", "content": f"def f{i}(x):"},
        {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}"}]}) + "\n" for i in range(6)))
    return root / "target", answers


def build(target, answers, out, *extra):
    return ar_draft.main(["--model", str(target), "--answers", str(answers), "--out", str(out), "--layers", "1",
                          "--batch-tokens", "128", "--heldout", "2", "--no-progress", *extra])


def test_cut_keeps_the_targets_bottom_layers_and_head(target_and_answers, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.core.model_files.tokenizer import load_tokenizer

    target, answers = target_and_answers
    threads = torch.get_num_threads()
    try:
        assert build(target, answers, tmp_path / "cut", "--steps", "0") == 0
        assert build(target, answers, tmp_path / "trained", "--steps", "2", "--warmup", "1", "--top-k", "4") == 0
    finally:
        torch.set_num_threads(threads)
    full = AutoModelForCausalLM.from_pretrained(str(target)).state_dict()
    cut = AutoModelForCausalLM.from_pretrained(str(tmp_path / "cut"))
    assert cut.config.num_hidden_layers == 1 and len(cut.model.layers) == 1
    for name, w in cut.state_dict().items():
        assert torch.equal(w, full[name]), name  # layer 0, embeddings, norm, head: the target's own
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained")).state_dict()
    assert torch.equal(trained["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # frozen
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], full["model.layers.0.mlp.up_proj.weight"])
    assert load_tokenizer(tmp_path / "trained").chat_template == load_tokenizer(target).chat_template
    info = json.loads((tmp_path / "trained" / "ar_draft.json").read_text())
    assert info["steps"] == 2 and info["train_rows"] == 4 and info["heldout_rows"] == 2 and info["layers"] == 1
    assert 0 <= info["after"]["agreement"] <= 1 and set(info["after"]["tau"]) == {str(k) for k in
                                                                                   TAU_DRAFT_LENGTHS}


def test_assisted_generation_with_the_draft_equals_the_target(target_and_answers, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from dflash.bench.methods import make_runner

    target, answers = target_and_answers
    threads = torch.get_num_threads()
    try:
        build(target, answers, tmp_path / "ar", "--steps", "1", "--warmup", "1")
        tok = AutoTokenizer.from_pretrained(str(target))
        cfg = {"target": str(target), "ar_draft": str(tmp_path / "ar"), "dtype": "auto", "device": "cpu",
               "threads": 1, "max_new_tokens": 8, "temperature": 0.0, "eos_token_ids": [], "ignore_eos": True,
               "pad_token_id": tok.pad_token_id}
        ids = tok("def add(a, b):")["input_ids"]
        base = make_runner(dict(cfg, method="hf_no_draft")).generate(ids, seed=0)
        assisted = make_runner(dict(cfg, method="assisted")).generate(ids, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert len(base["tokens"]) == 8 and assisted["tokens"] == base["tokens"]
    assert sum(assisted["acceptance_lengths"]) == 8


def test_greedy_tau_counts_tokens_per_cycle():
    # the first token is the prefill's; then drafts of k tokens run until the first miss, +1 from the target
    assert greedy_tau([True] * 9, 4) == pytest.approx(8 / 2)
    assert greedy_tau([True, False, False, False, False], 4) == pytest.approx(1.0)
    assert greedy_tau([True, True, False, True, True], 2) == pytest.approx(4 / 2)


def test_one_line_errors(target_and_answers, tmp_path):
    target, answers = target_and_answers
    with pytest.raises(DFlashError, match=r"--layers: got 4, expected 1..3 \(the target has 4 layers\)"):
        build(target, answers, tmp_path / "x", "--steps", "0", "--layers", "4")
    with pytest.raises(DFlashError, match="--answers: .*missing.jsonl does not exist"):
        build(target, tmp_path / "missing.jsonl", tmp_path / "x")
    with pytest.raises(DFlashError, match="expected a transformers model directory"):
        build(answers.parent / "target-tokenizer", answers, tmp_path / "x")
    assert not (tmp_path / "x").exists()
