"""`python -m dflash.generate`: the JSON contract other tools rely on, streaming mode, one-line errors."""

import json
import subprocess
import sys

import pytest


def run(*args, input=None):
    return subprocess.run([sys.executable, "-m", "dflash.generate", *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=300)


def test_json_contract(tiny_target_dir, random_draft_dir):
    p = run("--backend", "torch", "--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt", "def f(x):",
            "--max-new-tokens", 24, "--json", "--trace")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    keys = {"tokens", "text", "prompt_tokens", "generation_tokens", "acceptance_lengths", "mean_acceptance_length",
            "prefill_seconds", "decode_seconds", "decode_tokens_per_second", "finish_reason", "drafted"}
    assert keys <= out.keys()
    n = out["generation_tokens"]
    assert n == len(out["tokens"])
    assert n == 24 if out["finish_reason"] == "length" else out["tokens"][-1] == 2  # <|im_end|>
    lengths = out["acceptance_lengths"]  # the prefill's token is not a cycle; the last cycle may be cut
    assert sum(lengths[:-1]) < n - 1 <= sum(lengths)
    assert all(len(d) == 15 for d in out["drafted"])
    base = json.loads(run("--backend", "torch", "--model", tiny_target_dir, "--no-draft", "--prompt", "def f(x):",
                          "--max-new-tokens", 24, "--json").stdout)
    assert base["tokens"] == out["tokens"] and set(base["acceptance_lengths"]) == {1}


def test_prompt_ids_and_stream(tiny_target_dir, random_draft_dir):
    p = run("--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt-ids", "5,6,7", "--max-new-tokens", 8)
    assert p.returncode == 0, p.stderr
    assert "tau" in p.stderr.strip().splitlines()[-1]


def test_chat_template(tiny_target_dir, random_draft_dir):
    p = run("--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt", "hi", "--chat",
            "--max-new-tokens", 4, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["prompt_tokens"] > 3


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "nan"], "--top-p"),
    (["--block-size", "1"], "--block-size"),
    (["--block-size", "64"], "--block-size"),
    (["--backend", "jax"], "--backend"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "99999"], "--prompt-ids"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bad_flags_one_line(tiny_target_dir, random_draft_dir, args, needle):
    base = ["--model", tiny_target_dir, "--draft", random_draft_dir]
    if "--prompt-ids" not in args:
        base += ["--prompt", "x"]
    p = run(*base, *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1]
    assert "Traceback" not in p.stderr


def test_missing_draft_dir(tiny_target_dir, tmp_path):
    p = run("--model", tiny_target_dir, "--draft", tmp_path / "nope", "--prompt", "x")
    assert p.returncode == 2 and "--draft" in p.stderr


def test_empty_prompt(tiny_target_dir, random_draft_dir):
    p = run("--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt", "")
    assert p.returncode == 2 and "empty" in p.stderr
