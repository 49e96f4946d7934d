"""Training data: input formats, assistant-only loss masks per chat-template family, resumable regeneration,
offline feature cache == online features."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
torch = pytest.importorskip("torch")

from dflash.core.training.datasets import load_samples, read_rows, row_messages, tokenize_conversation
from dflash.core.errors import DFlashError

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# a template that rewrites history: earlier assistant turns lose their <think> part (like Qwen3's)
THINK_STRIPPING_TEMPLATE = (
    "{% for message in messages %}{% set c = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sum a list."},
        {"role": "assistant", "content": "def total(xs):\n    return sum(xs)"},
        {"role": "user", "content": "And the product?"},
        {"role": "assistant", "content": "import math\nmath.prod(xs)"}]


def supervised_spans(tok, ids, mask) -> list[str]:
    spans, cur = [], []
    for t, m in zip(ids + [None], mask + [False]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def test_chatml_assistant_tokens_only(tok):
    ids, mask = tokenize_conversation(tok, CHAT)
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert supervised_spans(tok, ids, mask) == [CHAT[2]["content"] + "<|im_end|>", CHAT[4]["content"] + "<|im_end|>"]


def test_llama3_assistant_tokens_only(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens": [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    ids, mask = tokenize_conversation(tok, CHAT)
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>") and not mask[0]
    assert supervised_spans(tok, ids, mask) == [CHAT[2]["content"] + "<|eot_id|>", CHAT[4]["content"] + "<|eot_id|>"]
    # the generation prompt's header is context, not a target
    header = tok.convert_tokens_to_ids("<|end_header_id|>")
    assert not any(m for t, m in zip(ids, mask) if t == header)


def test_template_that_rewrites_history_supervises_what_it_can(tok):
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.chat_template = THINK_STRIPPING_TEMPLATE
    chat = [dict(m) for m in CHAT]
    chat[2]["content"] = "<think>easy</think>def total(xs): return sum(xs)"
    ids, mask = tokenize_conversation(tok, chat)
    # the earlier turn is rendered differently inside the conversation than when it was generated: not trained on
    assert supervised_spans(tok, ids, mask) == [CHAT[4]["content"] + "<|im_end|>"]


def test_row_formats(tmp_path, tok):
    rows = [{"id": "a", "messages": CHAT[1:3]},
            {"conversations": [{"from": "human", "value": "Sum a list."},
                               {"from": "gpt", "value": CHAT[2]["content"]}]},
            {"id": "c", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
            {"id": "d", "messages": CHAT[1:3], "status": "failed"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    samples = load_samples(path, tok)
    assert [s["id"] for s in samples] == ["a", "row-1", "c"]  # failed rows are skipped
    assert samples[0]["input_ids"] == samples[1]["input_ids"] and samples[0]["loss_mask"] == samples[1]["loss_mask"]
    assert row_messages({"prompt": "hi"}, "x") == [{"role": "user", "content": "hi"}]
    # prompt-only rows are not training data
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(DFlashError, match=r"p.jsonl:1: no assistant turn.*regenerate"):
        load_samples(tmp_path / "p.jsonl", tok)
    (tmp_path / "bad.jsonl").write_text('{"messages": [}\n')
    with pytest.raises(DFlashError, match=r"bad.jsonl:1: not valid JSON"):
        load_samples(tmp_path / "bad.jsonl", tok)


def test_datasets_directory(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"messages": CHAT[1:3]}, {"messages": CHAT[1:5]}]).save_to_disk(str(tmp_path / "ds"))
    assert [r["messages"][0]["content"] for _, r in read_rows(tmp_path / "ds")] == ["Sum a list."] * 2
    assert len(load_samples(tmp_path / "ds", tok)) == 2


# ---- regenerate ---------------------------------------------------------------------------------------------------------
def prompts_file(path, n=16):
    rows = [{"prompt": f"def f{i}(x):"} for i in range(n)]
    rows[3] = {"nothing": "here"}  # no prompt: skipped, but accounted for
    rows[5] = {"id": "dup", "messages": [{"role": "user", "content": "a"}]}
    rows[6] = {"id": "dup", "messages": [{"role": "user", "content": "b"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_out(path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicated rows"
    return {r["id"]: r for r in rows}


def test_recover_output_cuts_a_torn_line(tmp_path):
    from dflash.backends.torch.regeneration import recover_output

    p = tmp_path / "o.jsonl"
    p.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "mess')
    assert recover_output(p) == {"a", "b"}
    assert p.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_answer_file_is_created_with_its_first_row(tmp_path):
    from dflash.core.training.answers import AnswerFile

    out = AnswerFile(tmp_path / "sub" / "answers.jsonl")
    out.close()  # stopped before any answer was finished
    assert not (tmp_path / "sub" / "answers.jsonl").exists()
    out = AnswerFile(tmp_path / "sub" / "answers.jsonl")
    out.append({"id": "a", "status": "ok"})
    out.close()
    assert (tmp_path / "sub" / "answers.jsonl").read_text() == '{"id": "a", "status": "ok"}\n'


@pytest.mark.slow
def test_regenerate_sigkill_and_resume(tiny_target_dir, tmp_path):
    inp = prompts_file(tmp_path / "prompts.jsonl")
    cmd = lambda out: [sys.executable, "-m", "dflash.data", "regenerate", "--model", str(tiny_target_dir),
                       "--input", str(inp), "--output", str(out), "--batch-size", "2", "--max-new-tokens", "24",
                       "--no-progress"]
    from dflash.backends.torch.regeneration import regenerate

    clean = tmp_path / "clean.jsonl"  # uninterrupted, in-process (same code path as the CLI)
    regenerate(tiny_target_dir, inp, clean, batch_size=2, max_new_tokens=24, device="cpu", progress=False,
               log=lambda m: None)
    stats = json.loads((tmp_path / "clean.stats.json").read_text())
    assert stats == {"ok": 15, "failed": 0, "skipped": 1, "total": 16, "input_rows": 16}
    want = read_out(clean)
    assert want["row-3"]["status"] == "skipped" and {"dup", "dup#1"} <= want.keys()
    ok = want["row-0"]
    assert ok["messages"][-1]["role"] == "assistant" and ok["thinking"] is False and ok["answer_tokens"] > 0

    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(cmd(out), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and \
            (not out.is_file() or out.read_text().count("\n") < 3):
        time.sleep(0.002)
    killed_mid_run = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(out, "a") as f:  # and as if it had died halfway through writing a row
        f.write('{"id": "row-14", "messages": [{"role": "us')
    r = subprocess.run(cmd(out), env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert killed_mid_run
    assert "already done" in r.stderr
    assert read_out(out) == want  # nothing lost, nothing duplicated, same answers (greedy)
    assert json.loads((tmp_path / "killed.stats.json").read_text()) == stats


def test_regenerated_rows_train(tiny_target_dir, tmp_path, tok):
    from dflash.backends.torch.regeneration import regenerate

    inp = prompts_file(tmp_path / "p.jsonl", n=8)
    regenerate(tiny_target_dir, inp, tmp_path / "a.jsonl", batch_size=4, max_new_tokens=8, device="cpu",
               progress=False, log=lambda m: None)
    samples = load_samples(tmp_path / "a.jsonl", tok)
    assert len(samples) == 7 and all(sum(s["loss_mask"]) >= 2 for s in samples)


# ---- offline features ------------------------------------------------------------------------------------------------------
def tokenised_rows(path, n=6, seed=0):
    """n tokenised training rows (ids and loss mask) of 12-30 tokens, written to `path`."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            ids = torch.randint(3, 500, (int(torch.randint(12, 30, (1,), generator=g)),), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (len(ids) - 3)}) + "\n")
    return path


def padded_ids(batch) -> torch.Tensor:
    width = max(len(s["input_ids"]) for s in batch)
    return torch.tensor([s["input_ids"] + [0] * (width - len(s["input_ids"])) for s in batch])


def test_feature_cache_equals_online_features_and_trains_the_same(tiny_target_dir, tmp_path):
    from dflash.backends.torch.target import load_target
    from dflash.backends.torch.training import TrainConfig, train
    from dflash.backends.torch.training.features import FeatureCache, OnlineFeatures
    from dflash.data import main

    data = tokenised_rows(tmp_path / "d.jsonl")
    feats = tmp_path / "feats"
    assert main(["cache-features", "--model", str(tiny_target_dir), "--data", str(data), "--out", str(feats),
                 "--num-layers", "2", "--feature-dtype", "float32", "--shard-gb", "0.00001"]) == 0
    cache = FeatureCache(feats)
    assert len(list(feats.glob("features-*.safetensors"))) > 1  # sharded
    samples = cache.samples()
    online = OnlineFeatures(load_target(tiny_target_dir, torch.float32, "cpu"), cache.target_layer_ids)
    batch = samples[:3]
    ids = padded_ids(batch)
    a, b = cache(batch, ids), online(batch, ids)
    for i, s in enumerate(batch):  # equal on real positions (padding is never attended to from real ones)
        n = len(s["input_ids"])
        torch.testing.assert_close(a[i, :n], b[i, :n], atol=1e-5, rtol=1e-5)
    online.close()
    common = dict(target=str(tiny_target_dir), num_layers=2, block_size=4, num_anchors=6, max_steps=3, batch_size=2,
                  save_every=0, progress=False, plot=False, quiet=True, device="cpu")
    on = train(TrainConfig(data=str(data), out=str(tmp_path / "on"), **common)).losses
    off = train(TrainConfig(features=str(feats), out=str(tmp_path / "off"), **common)).losses
    assert off == pytest.approx(on, rel=1e-4)


def test_cached_top_k_is_the_online_soft_label_and_trains_the_same(tiny_target_dir, tmp_path):
    """cache-features --top-k K keeps the target's K most likely next tokens at every position: the soft label of
    --kl-weight read from disk equals the one a frozen target forward gives, and a run trains the same on either."""
    from dflash.backends.torch.target import load_target
    from dflash.backends.torch.training import TrainConfig, train
    from dflash.backends.torch.training.features import FeatureCache, OnlineFeatures
    from dflash.backends.torch.training.objective import target_top_k
    from dflash.data import main

    data = tokenised_rows(tmp_path / "d.jsonl", seed=1)
    feats = tmp_path / "feats"
    assert main(["cache-features", "--model", str(tiny_target_dir), "--data", str(data), "--out", str(feats),
                 "--num-layers", "2", "--top-k", "8"]) == 0  # features in bfloat16, the default
    cache = FeatureCache(feats)
    assert cache.top_k == 8
    target = load_target(tiny_target_dir, torch.float32, "cpu")
    online = OnlineFeatures(target, cache.target_layer_ids)
    batch = cache.samples()[:3]
    ids = padded_ids(batch)
    _, (logp, top) = cache.with_top(batch, ids, 5)  # the first 5 of the 8 kept
    _, final = online.with_final(batch, ids)
    q, idx = target_top_k(target.get_output_embeddings(), final, 5)
    for i, s in enumerate(batch):
        n = len(s["input_ids"])
        assert torch.equal(top[i, :n], idx[i, :n])
        torch.testing.assert_close(torch.softmax(logp[i, :n], -1), q[i, :n], atol=2e-3, rtol=2e-3)  # float16 on disk
        assert torch.isinf(logp[i, n:]).all()  # padding: no probability
    online.close()

    common = dict(target=str(tiny_target_dir), num_layers=2, block_size=4, num_anchors=6, max_steps=3, batch_size=2,
                  save_every=0, progress=False, plot=False, quiet=True, device="cpu", kl_weight=0.5, kl_top_k=8)
    on = train(TrainConfig(data=str(data), out=str(tmp_path / "on"), **common)).losses
    off = train(TrainConfig(features=str(feats), out=str(tmp_path / "off"), **common)).losses
    assert off == pytest.approx(on, rel=2e-2)  # bfloat16 features against float32 ones
    with pytest.raises(DFlashError, match="--kl-top-k: got 16, but .* holds the target's top 8"):
        train(TrainConfig(features=str(feats), out=str(tmp_path / "wide"), **{**common, "kl_top_k": 16}))
