"""`python -m dflash.generate`: the JSON contract other tools rely on, streaming mode, one-line errors."""

import json
import subprocess
import sys

import pytest


def run(*args, input=None):
    return subprocess.run([sys.executable, "-m", "dflash.generate", *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=300)


@pytest.mark.parametrize("verify", ["auto", pytest.param("chain", marks=pytest.mark.slow),
                                    pytest.param("tree", marks=pytest.mark.slow)])
def test_json_contract(tiny_target_dir, random_draft_dir, verify):
    p = run("--backend", "torch", "--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt", "def f(x):",
            "--max-new-tokens", 24, "--json", "--trace", "--verify", verify, "--tree-budget", 6)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    keys = {"tokens", "text", "prompt_tokens", "generation_tokens", "acceptance_lengths", "mean_acceptance_length",
            "prefill_seconds", "decode_seconds", "decode_tokens_per_second", "finish_reason", "drafted",
            "verify_mode", "verified_tokens", "verified_per_cycle", "cycles_without_draft"}
    assert keys <= out.keys()
    assert out["verify_mode"] == verify and len(out["verified_per_cycle"]) == len(out["acceptance_lengths"])
    assert out["verified_tokens"] == sum(out["verified_per_cycle"])
    n = out["generation_tokens"]
    assert n == len(out["tokens"])
    assert n == 24 if out["finish_reason"] == "length" else out["tokens"][-1] == 2  # <|im_end|>
    lengths = out["acceptance_lengths"]  # the prefill's token is not a cycle; the last cycle may be cut
    assert sum(lengths[:-1]) < n - 1 <= sum(lengths)
    if verify == "chain":  # the trace holds every cycle's proposals; for trees, the accepted path's tokens
        assert all(len(d) == 15 for d in out["drafted"]) and set(out["verified_per_cycle"]) == {15}
    else:  # tree cycles trace the accepted path; auto's chain cycles their 15 proposals
        assert all(len(d) + 1 == n or (verify == "auto" and len(d) == v == 15)
                   for d, n, v in zip(out["drafted"], lengths, out["verified_per_cycle"]))
    if verify == "tree":
        assert max(out["verified_per_cycle"]) <= 6
    base = json.loads(run("--backend", "torch", "--model", tiny_target_dir, "--no-draft", "--prompt", "def f(x):",
                          "--max-new-tokens", 24, "--json").stdout)
    assert base["tokens"] == out["tokens"] and set(base["acceptance_lengths"]) == {1}
    # without a drafter no cycle runs a draft forward, and none verifies a draft token
    assert base["cycles_without_draft"] == len(base["acceptance_lengths"]) and base["verified_tokens"] == 0
    assert base["drafted_cycles_verifying_none"] == 0
    drafted = len(lengths) - out["cycles_without_draft"]
    assert 0 <= out["drafted_cycles_verifying_none"] <= drafted


def test_prompt_ids_and_stream(tiny_target_dir, random_draft_dir):
    p = run("--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt-ids", "5,6,7", "--max-new-tokens", 8)
    assert p.returncode == 0, p.stderr
    assert "tau" in p.stderr.strip().splitlines()[-1]


def test_stderr_holds_only_our_lines(tiny_target_dir, random_draft_dir):
    """No transformers weight-loading bar before the generation: stderr is the summary line and nothing else (but,
    on a machine so loaded that the tiny model takes over 5 s to load, our own "still loading" lines)."""
    p = run("--backend", "torch", "--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt", "def f(x):",
            "--max-new-tokens", 8, "--verify", "chain")
    lines = [line for line in p.stderr.splitlines() if not line.startswith("dflash: still loading ")]
    assert p.returncode == 0 and len(lines) == 1 and lines[0].startswith("tau "), p.stderr


def test_a_prompt_over_the_context_is_our_line_alone(tiny_target_dir, random_draft_dir):
    """transformers' "Token indices sequence length is longer than ..." warning does not come before our error."""
    p = run("--model", tiny_target_dir, "--draft", random_draft_dir, "--max-new-tokens", 2, input="x = 1\n" * 3000)
    assert p.returncode == 2 and "Token indices" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: prompt: ") and "context" in p.stderr


def test_transformers_without_torch_does_not_warn():
    """An MLX-only install uses transformers for tokenizers only: its "PyTorch was not found" advice is noise."""
    p = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import dflash, transformers"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "PyTorch was not found" not in p.stderr, p.stderr


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
    (["--itl-limit", "0.5"], "--itl-limit"),
    (["--itl-limit", "nan"], "--itl-limit"),
    (["--temperature", "0.7", "--accept", "rejection", "--verify", "tree"], "--accept rejection verifies chains"),
    (["--cache-len", "512"], "--cache-len: sizes the static cache of --compile"),
    (["--compile", "--cache-len", "0"], "--cache-len: got 0"),
    (["--compile", "--backend", "mlx"], "--compile: a torch option"),
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


def test_cuda_on_a_cpu_only_torch_is_one_line(tiny_target_dir, random_draft_dir):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this PyTorch has a CUDA device")
    p = run("--backend", "torch", "--model", tiny_target_dir, "--draft", random_draft_dir, "--prompt", "x",
            "--device", "cuda")
    assert p.returncode == 2 and p.stdout == ""
    # (one line; on a machine so loaded that importing torch takes over 5 s, our "still loading" lines before it)
    err = "".join(line for line in p.stderr.splitlines(keepends=True) if not line.startswith("dflash: still loading "))
    assert err.count("\n") == 1 and err.startswith("error: --device cuda: this PyTorch ("), p.stderr
    assert "use --device cpu" in p.stderr


def test_max_new_tokens_is_capped_to_the_context(tiny_target_dir, random_draft_dir, tmp_path):
    import shutil

    target = tmp_path / "ctx16"
    shutil.copytree(tiny_target_dir, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=16)))
    p = run("--backend", "torch", "--model", target, "--draft", random_draft_dir, "--prompt-ids", "5,6,7,8,9",
            "--max-new-tokens", 3000, "--json")
    assert p.returncode == 0, p.stderr
    assert ("dflash: --max-new-tokens 3000 capped to 11: the prompt's 5 tokens leave 11 of the target's context "
            "(max_position_embeddings 16)") in p.stderr.splitlines(), p.stderr  # (after the cost profile's lines)
    out = json.loads(p.stdout)
    assert out["generation_tokens"] <= 11 and (out["finish_reason"] == "stop" or out["generation_tokens"] == 11)


def test_sampling_flags_show_their_defaults():
    import argparse

    from dflash import cli

    class Recording(argparse.ArgumentParser):
        """Keeps the actions add_argument returns (argparse has no public list of a parser's actions)."""

        def __init__(self):
            super().__init__(add_help=False)
            self.added: list[argparse.Action] = []

        def add_argument(self, *args, **kwargs):
            self.added.append(super().add_argument(*args, **kwargs))
            return self.added[-1]

    p = Recording()
    cli.add_sampling_args(p)
    flags = p.added
    assert {a.option_strings[0] for a in flags} >= {"--max-new-tokens", "--temperature", "--top-p", "--seed"}
    for a in flags:
        shown = a.help % {"default": a.default}
        assert "default: " in shown, a.option_strings
        if a.default not in (None, []):
            assert f"default: {a.default}" in shown, a.option_strings
    assert "--max-new-tokens MAX_NEW_TOKENS tokens to generate at most (default: 256;" in " ".join(
        run("--help").stdout.split())


def test_models_json_into_a_closed_pipe_is_quiet():
    """`python -m dflash.models --json | head`: the reader leaves early; no BrokenPipe traceback."""
    p = subprocess.Popen([sys.executable, "-m", "dflash.models", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the child writes anything (it takes a second to start)
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("module, argv", [("generate", []), ("chat", []), ("bench.benchmark", []), ("data", ["regenerate"])])
def test_help_shows_the_generation_defaults(module, argv, capsys):
    import importlib
    import re

    with pytest.raises(SystemExit):
        importlib.import_module(f"dflash.{module}").parse_args([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-new-tokens MAX_NEW_TOKENS", "--temperature TEMPERATURE"):
        assert re.search(re.escape(flag) + r" (?:(?! --).)*default: [\d.]+", text), (module, flag)


@pytest.mark.slow
def test_a_seed_reproduces_under_the_default_verify_mode():
    """The bundled pair under the default --verify auto, sampled: the same --seed gives the same tokens on every run
    (each draw is keyed by its token's position, not by the cycles auto chose), and --help says so."""
    args = ("--prompt", "def fibonacci(n):", "--temperature", "0.8", "--seed", "5", "--max-new-tokens", "48", "--json")
    a, b = (json.loads(run(*args).stdout) for _ in range(2))
    assert a["tokens"] == b["tokens"] and a["verify_mode"] == "auto" and a["accept_rule"] == "match"
    assert "same tokens" in " ".join(run("--help").stdout.split())
