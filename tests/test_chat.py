"""`python -m dflash.chat` as a person uses it (a real REPL in a pseudo-terminal, a pipe, Ctrl-C) and the hub side:
registry lookups, an offline HF cache built from tiny models, `python -m dflash.models`, one-line offline errors."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SUMMARY = re.compile(r"tau ([\d.]+) \| ([\d.]+) tok/s \| (\d+) tokens \| prefill (\d+) new tokens \(reused (\d+)\)")
ENV = dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
           TERM="dumb")


def env(**extra) -> dict:
    return {**os.environ, **ENV, **{k: str(v) for k, v in extra.items()}}


def clean(text: str) -> str:
    return ANSI.sub("", text).replace("\r\n", "\n")


def spawn(*args, **extra_env):
    return pexpect.spawn(sys.executable, ["-m", "dflash.chat", *map(str, args)], env=env(**extra_env),
                         encoding="utf-8", codec_errors="replace", timeout=120, dimensions=(50, 400))


def run(module: str, *args, input: str | None = "", **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], input=input, capture_output=True,
                          text=True, env=env(**extra_env), timeout=300)


def put_in_hf_cache(hub_dir: Path, repo_id: str, src: Path, files=None) -> Path:
    """The layout huggingface_hub writes: blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/..., refs/main."""
    repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(src.iterdir()):
        if f.is_file() and (files is None or f.name in files):
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_target_dir, random_draft_dir):
    """An offline HF cache: Qwen/Qwen3-8B (the tiny target) with its registry drafter, Qwen/Qwen3-4B without its
    drafter, and org/partial whose snapshot lacks weights."""
    home = tmp_path_factory.mktemp("hf_home")
    hub_dir = home / "hub"
    put_in_hf_cache(hub_dir, "Qwen/Qwen3-8B", tiny_target_dir)
    put_in_hf_cache(hub_dir, "z-lab/Qwen3-8B-DFlash-b16", random_draft_dir)
    put_in_hf_cache(hub_dir, "Qwen/Qwen3-4B", tiny_target_dir)
    put_in_hf_cache(hub_dir, "org/partial", tiny_target_dir, files={"config.json"})
    return home


@pytest.fixture(scope="module")
def pipe(tiny_target_dir, random_draft_dir):
    import dflash

    return dflash.load(tiny_target_dir, random_draft_dir, backend="torch")


def greedy_reply(pipe, messages, max_new_tokens):
    from dflash.api import chat_ids

    return pipe.generate(chat_ids(pipe.tokenizer, messages), max_new_tokens=max_new_tokens)


# ---- the REPL in a pseudo-terminal --------------------------------------------------------------------------------
def test_repl_two_turns_stats_exit(tiny_target_dir, random_draft_dir, pipe):
    c = spawn("--backend", "torch", "--model", tiny_target_dir, "--draft", random_draft_dir, "--max-new-tokens", 12)
    try:
        c.expect_exact(">> ")
        assert "dflash chat | torch" in clean(c.before)
        c.sendline("def add(a, b):")
        c.expect_exact(">> ")
        turn1 = clean(c.before)
        c.sendline("and now subtract")
        c.expect_exact(">> ")
        turn2 = clean(c.before)
        c.sendline("/stats")
        c.expect_exact(">> ")
        stats = clean(c.before)
        c.sendline("/exit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0

    # the streamed answer is the target's greedy answer
    expected = greedy_reply(pipe, [{"role": "user", "content": "def add(a, b):"}], 12)
    assert expected.text.strip() and expected.text in turn1
    s1, s2 = SUMMARY.search(turn1), SUMMARY.search(turn2)
    assert s1 and s2, (turn1, turn2)
    new1, reused1, n1 = int(s1[4]), int(s1[5]), int(s1[3])
    new2, reused2 = int(s2[4]), int(s2[5])
    assert reused1 == 0 and n1 == expected.generation_tokens
    # turn 2 reuses the whole first turn, its reply included (all but the reply's last token, never fed back);
    # only the rendered tail (end of turn, the new user message, the assistant header) is prefilled
    tail = "<|im_end|>\n<|im_start|>user\nand now subtract<|im_end|>\n<|im_start|>assistant\n"
    n_tail = len(pipe.tokenizer(tail, add_special_tokens=False)["input_ids"])
    assert reused2 >= new1 + n1 - 2
    assert new2 <= n_tail + 1
    assert "tau" in stats and "acceptance by draft position 1..15" in stats and "speedup" in stats
    assert "2 replies" in stats
    assert "verify auto:" in stats and "cycles ran a draft forward" in stats  # the budgets auto chose


def test_ctrl_c_stops_the_reply_not_the_session(tiny_target_dir, random_draft_dir):
    c = spawn("--backend", "torch", "--model", tiny_target_dir, "--draft", random_draft_dir,
              "--max-new-tokens", 100000)
    try:
        c.expect_exact(">> ")
        c.sendline("hello")
        c.expect_exact("hello")
        c.expect(r"\S{12}")  # the reply is streaming
        c.sendintr()
        c.expect_exact("[interrupted]")
        c.expect_exact(">> ")
        first = clean(c.before)
        c.sendline("again")
        c.expect_exact("again")
        c.expect(r"\S{12}")
        c.sendintr()
        c.expect_exact("[interrupted]")
        c.expect_exact(">> ")
        second = clean(c.before)
        c.sendline("/exit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0
    s1, s2 = SUMMARY.search(first), SUMMARY.search(second)
    assert s1 and s2 and "stopped" in first and "stopped" in second
    assert 0 < int(s1[3]) < 3000  # far from the 4096-token context the long --max-new-tokens was capped to
    # the partial reply stayed in the conversation and in the cache: turn 2 reuses all of turn 1
    assert int(s2[5]) >= int(s1[4]) + int(s1[3]) - 2


# ---- pipe mode, with hub ids from an offline HF cache -------------------------------------------------------------
def test_pipe_answers_and_exits_with_registry_drafter(hf_home, pipe):
    p = run("dflash.chat", "--backend", "torch", "--model", "Qwen/Qwen3-8B", "--max-new-tokens", 10,
            input="def f(x):\n", HF_HOME=hf_home)
    assert p.returncode == 0, p.stderr
    expected = greedy_reply(pipe, [{"role": "user", "content": "def f(x):"}], 10).text
    assert p.stdout == (expected if expected.endswith("\n") else expected + "\n")  # the answer and nothing else
    assert SUMMARY.search(p.stderr.strip().splitlines()[-1])


def test_hub_resolve_from_cache(hf_home):
    code = """
import json
from dflash import hub
from dflash.core.errors import DFlashError
out = {"target": str(hub.resolve("Qwen/Qwen3-8B")), "draft_id": hub.draft_for("Qwen/Qwen3-8B")}
out["draft"] = str(hub.resolve(out["draft_id"], "--draft"))
for name in ("org/partial", "org/absent"):
    try:
        hub.resolve(name)
    except DFlashError as e:
        out[name] = str(e)
print(json.dumps(out))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(HF_HOME=hf_home),
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    hub_dir = Path(hf_home) / "hub"
    assert Path(out["target"]).parent == hub_dir / "models--Qwen--Qwen3-8B" / "snapshots"
    assert (Path(out["target"]) / "model.safetensors").is_file()
    assert out["draft_id"] == "z-lab/Qwen3-8B-DFlash-b16"
    assert Path(out["draft"]).is_relative_to(hub_dir / "models--z-lab--Qwen3-8B-DFlash-b16")
    assert "no *.safetensors" in out["org/partial"] and "hf download org/partial" in out["org/partial"]
    assert "HF_HUB_OFFLINE" in out["org/absent"] and "hf download org/absent" in out["org/absent"]


def test_draft_for_registry():
    from dflash import hub

    assert hub.draft_for("Qwen/Qwen3-8B") == "z-lab/Qwen3-8B-DFlash-b16"
    assert hub.draft_for("/models/Qwen3-4B") == "z-lab/Qwen3-4B-DFlash-b16"  # a local copy, by its name
    assert hub.draft_for("meta-llama/Llama-3.1-8B-Instruct") == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    assert hub.draft_for("someone/unknown") is None
    assert all(hub.is_repo_id(p.target) or p.target in hub.PREPARED for p in hub.PAIRS)
    assert all(p.draft is None or hub.is_repo_id(p.draft) or p.draft in hub.BUNDLED_DRAFTERS for p in hub.PAIRS)


def test_models_lists_registry_and_cache(hf_home):
    p = run("dflash.models", HF_HOME=hf_home)
    assert p.returncode == 0, p.stderr
    assert re.search(r"\n  Qwen/Qwen3-8B +[\d.]+[KMG] +z-lab/Qwen3-8B-DFlash-b16 +[\d.]+[KMG] +torch, mlx\n", p.stdout)
    assert re.search(r"\n  Qwen/Qwen3-4B +[\d.]+[KMG] +z-lab/Qwen3-4B-DFlash-b16 +- +torch, mlx\n", p.stdout)
    assert re.search(r"\n  z-lab/Qwen3-8B-DFlash-b16 +[\d.]+[KMG] +drafter\n", p.stdout)
    assert "z-lab/Qwen3.5-9B-DFlash" in p.stdout
    assert re.search(r"\n  smollm2 +- +smollm2-dflash +[\d.]+M \(in the package\) +torch, mlx\n", p.stdout)
    assert f"HF cache {Path(hf_home) / 'hub'}: 4 model(s)" in p.stdout
    assert "hf download" in p.stdout
    data = json.loads(run("dflash.models", "--json", HF_HOME=hf_home).stdout)
    assert {r["repo"] for r in data["cached"]} == {"Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "Qwen/Qwen3-4B",
                                                    "org/partial"}
    assert [q["draft_cached"] for q in data["pairs"] if q["draft"] == "smollm2-dflash"] == [True]


def test_offline_missing_model_is_one_line(hf_home):
    before = sorted(p.name for p in (Path(hf_home) / "hub").iterdir())
    p = run("dflash.chat", "--model", "Qwen/Qwen3-Coder-30B-A3B-Instruct", input="hi\n", HF_HOME=hf_home)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stdout == ""
    assert p.stderr.startswith("error: --model: Qwen/Qwen3-Coder-30B-A3B-Instruct is not in the HF cache")
    assert "hf download Qwen/Qwen3-Coder-30B-A3B-Instruct --include '*.json' --include '*.safetensors'" in p.stderr
    # the target is cached but its registry drafter is not: the line names --draft and what to fetch
    p = run("dflash.chat", "--model", "Qwen/Qwen3-4B", input="hi\n", HF_HOME=hf_home)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("error: --draft: z-lab/Qwen3-4B-DFlash-b16 is not in the HF cache")
    # a listed family the chosen backend cannot draft for is refused before anything is fetched
    p = run("dflash.chat", "--model", "google/gemma-4-12B-it", "--backend", "mlx", input="hi\n", HF_HOME=hf_home)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("error: --model: google/gemma-4-12B-it is not supported by the mlx backend")
    assert sorted(p.name for p in (Path(hf_home) / "hub").iterdir()) == before  # nothing half-written


# ---- in-process: conversation rendering, --max-context ------------------------------------------------------------
def test_plain_completion_without_template(tiny_target_dir):
    from transformers import AutoTokenizer

    from dflash.chat import Conversation

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    tok.chat_template = None
    conv = Conversation(tok)
    assert not conv.templated
    assert conv.text("def f(x):", []) == "def f(x):"
    reply = "\n    return x"
    conv.add("def f(x):", conv.ids("def f(x):"), reply, tok(reply, add_special_tokens=False)["input_ids"])
    assert conv.text("def g(y):", conv.turns) == "def f(x):\n    return x\ndef g(y):"
    assert conv.ids("def g(y):")[:len(conv.exact[1])] == conv.exact[1]


def test_thinking_flag_reaches_the_template(tiny_target_dir):
    from transformers import AutoTokenizer

    from dflash.chat import Conversation, parse_args

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    for flags, thinking in (([], None), (["--enable-thinking"], True), (["--disable-thinking"], False)):
        assert parse_args(flags).thinking is thinking
    assert Conversation(tok, "be brief", False).text("hi", []) == "system: be brief\nuser: hi\n<think></think>"
    assert Conversation(tok, None, True).text("hi", []) == "user: hi\n"


def test_max_context_drops_oldest_turns(pipe):
    from dflash.chat import Chat, parse_args

    out, err = io.StringIO(), io.StringIO()
    chat = Chat(pipe, parse_args(["--max-new-tokens", "6", "--max-context", "80"]), out=out, err=err)
    messages = ["first message: " + "lists and dicts " * 4, "second message: " + "sets " * 8, "third: " + "tuples " * 8]
    for m in messages:
        chat.turn(m)
    assert "dropped the" in err.getvalue()
    assert [u for u, _ in chat.conv.turns][-1] == messages[-1] and len(chat.conv.turns) < 3
    assert len(pipe.engine.cached_tokens) <= 80
    with pytest.raises(Exception, match="--max-context"):
        chat.turn("x " * 200)
    chat.command("/reset")
    assert chat.conv.turns == [] and chat.report() == ["no replies yet"]


def test_an_interrupted_reply_is_its_tokens_whole_text(pipe, monkeypatch):
    """Ctrl-C lands after a cycle whose text the stream held back in part (a character cut in two): the reply shown
    and kept is its tokens' whole text, so the next turn's prompt starts with the very ids the cache holds (had the
    held-back text been lost, the next prompt would be tokenised afresh and reuse less of the cache)."""
    import signal

    from dflash.chat import Chat, parse_args
    from dflash.core.loop import Increment

    tokens = pipe.tokenizer("x = 'caf\u00e9'", add_special_tokens=False)["input_ids"]
    whole = pipe.tokenizer.decode(tokens, skip_special_tokens=False)

    class HeldBack:  # a stream whose last cycle's text lacks its final character, then Ctrl-C
        result = None

        def __iter__(self):
            yield Increment(tokens[:1], pipe.tokenizer.decode(tokens[:1]))
            os.kill(os.getpid(), signal.SIGINT)  # (StopOnSigint: stop after this cycle)
            yield Increment(tokens[1:], whole[len(pipe.tokenizer.decode(tokens[:1])):-1])

    monkeypatch.setattr(pipe, "stream", lambda *a, **k: HeldBack())
    out = io.StringIO()
    chat = Chat(pipe, parse_args(["--max-new-tokens", "6"]), out=out, err=io.StringIO())
    assert chat.turn("hello") == whole and out.getvalue() == whole + "\n[interrupted]\n"
    assert chat.conv.exact is not None and chat.conv.exact[1][-len(tokens):] == tokens
    assert chat.conv.ids("next")[:len(chat.conv.exact[1])] == chat.conv.exact[1]


def test_a_message_over_the_targets_context_names_no_unpassed_flag(pipe):
    from dflash.chat import Chat, parse_args

    chat = Chat(pipe, parse_args(["--max-new-tokens", "6"]), out=io.StringIO(), err=io.StringIO())
    with pytest.raises(Exception, match="the target's context of") as e:
        chat.turn("x = 1\n" * 3000)
    assert "--max-context" not in str(e.value)


def test_stats_answer_from_the_session_and_agree_with_themselves(pipe):
    """/stats runs and times nothing (it once timed target steps, for seconds, while keys typed meanwhile became the
    next messages); cycles that drafted are told apart from those that ran none, each with the tokens it committed,
    and the bound it states is tokens per cycle, with the share of the tokens that drafted cycles committed."""
    from dflash.chat import Chat, Stats, parse_args

    chat = Chat(pipe, parse_args(["--max-new-tokens", "6"]), out=io.StringIO(), err=io.StringIO())
    chat.turn("def add(a, b):")
    chat.stats = Stats(replies=1, tokens=13, lengths=[1, 1, 4, 3, 3, 1], decode_tokens=12, decode_seconds=1.2,
                       verified=[0, 0, 3, 0, 0, 0], draft_forwards=[True, True, True, False, False, False])
    engine = pipe.engine

    def refuse(*args, **kwargs):
        raise AssertionError("/stats ran the model")
    for name in ("prefill", "step", "crop", "admit"):
        setattr(engine, name, refuse)
    try:
        report = "\n".join(chat.report())
    finally:
        for name in ("prefill", "step", "crop", "admit"):
            delattr(engine, name)
    assert "tau 2.17 tokens per cycle" in report
    assert "3 of 6 cycles ran a draft forward and committed 2.00 tokens each, verifying 1.0" in report
    assert "2 of them verified none" in report and "3 ran none (the drafter paused) and committed 2.33 tokens each" \
        in report
    assert "at most 2.17x" in report and "46% of the tokens came from cycles that drafted" in report
    assert "measured:" not in report and "target step takes" not in report


def test_reply_capped_by_the_context_says_so(pipe):
    from dflash.chat import Chat, parse_args

    out, err = io.StringIO(), io.StringIO()
    chat = Chat(pipe, parse_args(["--max-new-tokens", "500", "--max-context", "40"]), out=out, err=err)
    chat.turn("hi")
    status = err.getvalue().strip().splitlines()[-1]
    room = int(re.search(r"capped at (\d+) tokens: the context holds 40", status).group(1))
    assert 0 < room < 40 and int(re.search(r"\| (\d+) tokens \|", status).group(1)) <= room


def test_bundled_pair_hint():
    from dflash.reference import reference_dirs

    try:
        reference_dirs()
    except Exception:
        pytest.skip("the bundled reference assets are not built in this checkout")
    c = spawn("--backend", "torch", "--max-new-tokens", 4)
    try:
        c.expect_exact(">> ")
        assert "--model Qwen/Qwen3-8B" in clean(c.before)
        c.sendline("def fibonacci(n):")
        c.expect_exact(">> ")
        assert SUMMARY.search(clean(c.before))
        c.sendeof()
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0

