"""Build the bundled reference pair from scratch, with fixed seeds:

    corpus -> tokenizer -> target (pretrain) -> prompts -> regenerate (target answers) -> drafter -> export -> tau

    python -m dflash.reference build                  # the full build (~60-70 min on 2 CPU cores), into runs/reference
    python -m dflash.reference build --install        # ... and copy the result into the package (dflash/reference)
    python -m dflash.reference build --fast --out D   # a tiny end-to-end build in well under a minute (CI)
    python -m dflash.reference build --target dflash/reference/assets/target --out D   # the drafter only (~35 min)

Rerunning a build resumes it: a finished phase whose inputs match what --out holds is kept (the pretrained target,
each answers file, the drafter run), an interrupted regeneration keeps its answers and continues, and an
interrupted drafter run continues from its last checkpoint (every 100 steps). Pretraining restarts if it was
interrupted. --fresh builds everything again.

Everything lands under --out: tokenizer/, target_f32/ (pretrained, float32), pretrain.jsonl (curve),
train_prompts.jsonl, prompts.jsonl (benchmark, held-out files), answers_{chat,completion}.jsonl (the target's
answers), drafter/ (training run), assets/target + assets/draft (float16, what ships), build.json (costs, tau,
samples).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash import cli
from dflash.core.errors import DFlashError

PACKAGE_DIR = Path(__file__).parent


@dataclass
class BuildConfig:
    seed: int = 0
    limit_bytes: int | None = None  # corpus subset (fast build)
    vocab_size: int = 4088  # tokenizer vocabulary; the embedding table adds 8 spare rows (mask token)
    pretrain: dict = field(default_factory=dict)  # PretrainConfig overrides
    train_prompts: int = 1200  # prompts answered by the target for drafter training
    benchmark_prompts: int = 32
    train_prompt_max_chars: int = 400  # prompt + answer stay inside the target's trained context (seq_len)
    benchmark_max_chars: int = 500
    answer_tokens: int = 160  # max new tokens per regenerated answer
    # the target answers every training prompt twice: as a ChatML user turn, and as plain completion (how
    # `python -m dflash.generate --prompt` serves it without --chat); the drafter trains on both
    answer_formats: tuple[str, ...] = ("chat", "completion")
    # TrainConfig overrides (dflash.train; the rest are its defaults, e.g. draft layers copied from the target's
    # first layers). ~40 min at one thread on a Xeon with AMX (bf16 autocast, ~0.85 s/step), held-out acceptance
    # every 700 steps; dtype auto: bf16 autocast where the CPU multiplies bf16 in hardware, float32 elsewhere
    drafter: dict = field(default_factory=lambda: dict(num_layers=3, block_size=16, num_anchors=64, batch_size=4,
                                                       lr=2e-3, max_steps=2800, dtype="auto", log_every=10,
                                                       eval_every=700, eval_at_start=True, eval_holdout=16,
                                                       eval_max_prompts=8, eval_max_new_tokens=96))
    tau_prompts: int = 32
    tau_new_tokens: int = 128

    @classmethod
    def fast(cls) -> "BuildConfig":
        return cls(limit_bytes=250_000, vocab_size=376,
                   pretrain=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=32, intermediate_size=128, steps=12, batch_size=4, seq_len=128,
                                 warmup_steps=2, eval_every=100, eval_batches=1, compile=False, log_every=4,
                                 max_seconds=None),
                   train_prompts=8, benchmark_prompts=4, answer_tokens=16,
                   drafter=dict(num_layers=1, block_size=4, max_steps=4, num_anchors=16, batch_size=2),
                   tau_prompts=2, tau_new_tokens=12)


def _log(msg: str) -> None:
    print(f"[reference] {msg}", flush=True)


def build(out: str | Path, cfg: BuildConfig | None = None, fresh: bool = False, target: str | Path | None = None,
          answers_only: bool = False) -> dict:
    """The whole pipeline. `target`: an exported target directory (e.g. the bundled one) used as it is instead of
    training a tokenizer and pretraining (the drafter recipe alone, ~22 min shorter). `answers_only`: stop once the
    target's answers are written (the data that drafter experiments train on)."""
    import torch

    from .tiny import train_tokenizer

    from . import prompts as P
    from .corpus import source_files, split
    from .pretrain import PretrainConfig, plot_curve, pretrain

    cfg = cfg or BuildConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"config": asdict(cfg), "timings": {}}
    t_all = time.time()

    def timed(name, fn, *a, **k):
        t = time.time()
        r = fn(*a, **k)
        report["timings"][name] = round(time.time() - t, 1)
        _log(f"{name}: {report['timings'][name]} s")
        return r

    # 1. corpus and tokenizer (train files only)
    train_files, heldout_files = split(source_files(limit_bytes=cfg.limit_bytes))
    report["corpus"] = {"train_files": len(train_files), "heldout_files": len(heldout_files),
                        "train_chars": sum(len(f.text) for f in train_files)}
    if target is None:
        tok = timed("tokenizer", train_tokenizer, [f.text for f in train_files], cfg.vocab_size, out / "tokenizer",
                    model_max_length=cfg.pretrain.get("max_position_embeddings", 2048))

        # 2. target
        pcfg = PretrainConfig(seed=cfg.seed, **cfg.pretrain)
        done = out / "target_f32" / "pretrain_summary.json"
        if not fresh and done.is_file() and json.loads(done.read_text())["config"] == json.loads(
                json.dumps(asdict(pcfg))):
            _log(f"pretrain: keeping {done.parent} (same config)")
            summary = json.loads(done.read_text())
        else:
            if fresh:
                (out / ".target_f32.checkpoint.pt").unlink(missing_ok=True)  # (an interrupted run's, see pretrain)
            summary = timed("pretrain", pretrain, train_files, heldout_files, tok, pcfg, out / "target_f32",
                            out / "pretrain.jsonl", progress=True)
        report["target"] = {k: v for k, v in summary.items() if k != "config"}
        plot_curve(out / "pretrain.jsonl", out / "pretrain.png")
    else:
        target = Path(target)
        if not (target / "model.safetensors").is_file() or not (target / "tokenizer.json").is_file():
            raise DFlashError(f"--target: {target} is not an exported target (model.safetensors + tokenizer.json)")
        report["target"] = {"from": str(target)}

    # 3. prompts: training prompts from train files, benchmark prompts from held-out files
    train_prompts = P.training_prompts(train_files, limit=cfg.train_prompts, seed=cfg.seed,
                                         max_chars=cfg.train_prompt_max_chars)
    P.write_jsonl(train_prompts, out / "train_prompts.jsonl")
    bench = P.benchmark_prompts(heldout_files, [f.text for f in train_files] + [p.prompt for p in train_prompts],
                                n=cfg.benchmark_prompts, seed=cfg.seed, max_chars=cfg.benchmark_max_chars)
    P.write_jsonl(bench, out / "prompts.jsonl")
    report["prompts"] = {"train": len(train_prompts), "benchmark": len(bench)}

    # 4. the target's own answers (greedy), then 5. the drafter
    if target is None:
        export_target(out / "target_f32", out / "assets" / "target")
    elif target.resolve() != (out / "assets" / "target").resolve():
        shutil.rmtree(out / "assets" / "target", ignore_errors=True)
        shutil.copytree(target, out / "assets" / "target")
    report["answers"], samples = {}, []
    for fmt in cfg.answer_formats:
        target = out / "assets" / "target" if fmt == "chat" else completion_target(out / "assets" / "target",
                                                                                  out / "completion_target")
        path = out / f"answers_{fmt}.jsonl"
        report["answers"][fmt] = timed(f"regenerate_{fmt}", regenerate, target, train_prompts, path,
                                       cfg.answer_tokens, fresh=fresh)
        samples += answer_samples(target, path)
    report["answers"]["samples"] = len(samples)
    report["answers"]["supervised_tokens"] = sum(sum(x["loss_mask"]) for x in samples)
    if answers_only:
        (out / "build.json").write_text(json.dumps(report, indent=2) + "\n")
        return report
    result = timed("drafter", train_drafter, out / "assets" / "target", samples, out / "drafter", cfg, fresh)
    report["drafter"] = {"steps": result.steps, "final_loss": result.losses[-1] if result.losses else None,
                         "seconds": round(result.seconds, 1)}

    # 6. export (float16) and 7. acceptance on the benchmark prompts with the real loop
    export_drafter(result.draft_dir, out / "assets" / "draft")
    torch.manual_seed(cfg.seed)
    report["benchmark"] = timed("tau", measure_tau, out / "assets" / "target", out / "assets" / "draft",
                                [p.prompt for p in bench[:cfg.tau_prompts]], cfg.tau_new_tokens)
    report["sizes_bytes"] = {d: sum(f.stat().st_size for f in (out / "assets" / d).iterdir())
                             for d in ("target", "draft")}
    report["total_seconds"] = round(time.time() - t_all, 1)
    (out / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"done in {report['total_seconds']} s: tau {report['benchmark']['tau']:.2f}; {out / 'build.json'}")
    return report


def regenerate(target_dir: Path, prompts: list, path: Path, max_new_tokens: int, batch_size: int = 32,
               fresh: bool = False) -> dict:
    """The target's greedy answers to the training prompts (`python -m dflash.data regenerate`, in process): each
    prompt is the user turn of a ChatML conversation, the target writes the assistant turn. Answers already in
    `path` for the same prompts, token budget and target weights are kept (unless `fresh`): a finished file is
    used as it is, an interrupted one is continued."""
    from dflash.backends.torch import regenerate as answer
    from dflash.core.io import atomic_write_text

    inp = path.with_name("regenerate_input.jsonl")
    text = "".join(json.dumps({"id": f"p{i}", "prompt": p.prompt}) + "\n" for i, p in enumerate(prompts))
    meta = {"inputs": _sha256(text.encode()), "max_new_tokens": max_new_tokens,
            "target": _sha256((target_dir / "model.safetensors").read_bytes())}
    meta_path, stats_path = path.with_suffix(".meta.json"), path.with_name(path.stem + ".stats.json")
    same = not fresh and meta_path.is_file() and json.loads(meta_path.read_text()) == meta
    if same and path.is_file() and stats_path.is_file():  # the stats are written when the last answer is
        _log(f"regenerate: keeping {path} (same prompts, budget and target)")
        return json.loads(stats_path.read_text())
    if not same:  # answers to other prompts or by another target: start over
        for old in (path, stats_path, meta_path):
            old.unlink(missing_ok=True)
    atomic_write_text(inp, text)
    atomic_write_text(meta_path, json.dumps(meta) + "\n")  # before the first answer, so that a rerun continues
    return answer(target_dir, inp, path, batch_size=batch_size, temperature=0.0, max_new_tokens=max_new_tokens,
                  device="cpu", dtype="float32", progress=True, log=_log)


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


COMPLETION_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def completion_target(target_dir: Path, dst: Path) -> Path:
    """The target with a plain-completion chat template (the prompt as is, no markers), so that `regenerate` and
    the trainer's tokenisation see exactly what plain `generate --prompt` feeds the target."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(target_dir, dst)
    (dst / "chat_template.jinja").write_text(COMPLETION_TEMPLATE)
    return dst


def answer_samples(target_dir: Path, path: Path) -> list[dict]:
    """Tokenised training samples of regenerated answers, rendered with that target directory's template."""
    from dflash.core.training.datasets import load_samples
    from dflash.core.model_files.tokenizer import load_tokenizer

    return load_samples(path, load_tokenizer(target_dir))



def build_samples(data: Path) -> list[dict]:
    """The drafter's training samples of a build directory (`--answers-only`): the target's chat and plain-completion
    answers, each rendered with its own template."""
    data = Path(data)
    target_dir = data / "assets" / "target"
    return answer_samples(target_dir, data / "answers_chat.jsonl") + \
        answer_samples(completion_target(target_dir, data / "completion_target"), data / "answers_completion.jsonl")

def train_drafter(target_dir: Path, samples: list[dict], out: Path, cfg: BuildConfig, fresh: bool = False):
    """`python -m dflash.train`, in process, on the target's answers (loss on the answer tokens only). A run of the
    same samples, target and recipe in `out` resumes from its last checkpoint; any other is started over."""
    from dflash.core.io import atomic_write_text
    from dflash.core.training.train_config import TrainConfig
    from dflash.train import run_training

    recipe = dict(dtype="float32", save_every=100) | cfg.drafter
    inputs = {"samples": _sha256(json.dumps([[list(x["input_ids"]), list(x["loss_mask"])] for x in samples]).encode()),
              "target": _sha256((target_dir / "model.safetensors").read_bytes()), "seed": cfg.seed,
              "recipe": json.loads(json.dumps(recipe))}
    inputs_path = out.with_name(out.name + ".inputs.json")
    same = not fresh and inputs_path.is_file() and json.loads(inputs_path.read_text()) == inputs
    if out.exists() and not same:
        shutil.rmtree(out)  # checkpoints of other inputs
    atomic_write_text(inputs_path, json.dumps(inputs) + "\n")
    tc = TrainConfig(target=str(target_dir), samples=samples, out=str(out), seed=cfg.seed, device="cpu", plot=True,
                     progress=True, resume=True, **recipe)
    return run_training(tc)


def export_target(src: Path, dst: Path) -> None:
    """float16 weights + tokenizer + generation_config (greedy; both end tokens stop)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.core.io import atomic_directory

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float16)
    tok = AutoTokenizer.from_pretrained(str(src))
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = False
    with atomic_directory(dst) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))


def export_drafter(src: Path, dst: Path) -> None:
    import torch

    from dflash.backends.torch import load_drafter, save_drafter
    from dflash.core.io import atomic_directory

    model = load_drafter(src, dtype=torch.float32)
    with atomic_directory(dst) as tmp:
        save_drafter(model, tmp, dtype=torch.float16)


def measure_tau(target_dir: Path, draft_dir: Path, prompts: list[str], max_new_tokens: int) -> dict:
    """Greedy acceptance with the real speculative loop, pooled over prompts; checks losslessness on the way."""
    from tqdm import tqdm

    import dflash
    from dflash.core.output import acceptance_histogram, mean_acceptance_length, per_position_acceptance

    spec_pipe = dflash.load(target_dir, draft_dir, backend="torch", device="cpu")
    plain = dflash.load(target_dir, backend="torch", device="cpu", no_draft=True)
    lengths, rows, t_spec, t_plain, n_tok = [], [], 0.0, 0.0, 0
    for p in tqdm(prompts, desc="tau", dynamic_ncols=True):
        r = spec_pipe.generate(p, max_new_tokens=max_new_tokens)
        base = plain.generate(p, max_new_tokens=max_new_tokens)
        if r.tokens != base.tokens:
            raise DFlashError(f"reference build: speculative output differs from target-only output for {p[:40]!r}")
        lengths += r.acceptance_lengths
        t_spec += r.decode_seconds
        t_plain += base.decode_seconds
        n_tok += r.generation_tokens
        rows.append({"prompt": p, "completion": r.text, "tau": r.mean_acceptance_length,
                     "tokens": r.generation_tokens})
    b = spec_pipe.engine.block_size
    return {"tau": mean_acceptance_length(lengths), "cycles": len(lengths), "tokens": n_tok,
            "histogram": acceptance_histogram(lengths, b), "per_position": per_position_acceptance(lengths, b),
            "decode_seconds_speculative": round(t_spec, 3), "decode_seconds_target_only": round(t_plain, 3),
            "per_prompt": rows}


def install(out: Path) -> None:
    """Copy a build's float16 assets and benchmark prompts into the package."""
    for name in ("target", "draft"):
        dst = PACKAGE_DIR / "assets" / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(out / "assets" / name, dst)
    shutil.copyfile(out / "prompts.jsonl", PACKAGE_DIR / "prompts.jsonl")


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.reference build", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/reference", help="build directory (default: runs/reference)")
    p.add_argument("--fast", action="store_true", help="tiny corpus, model and drafter: tests the pipeline")
    p.add_argument("--install", action="store_true", help="copy the result into the package afterwards")
    p.add_argument("--fresh", action="store_true",
                   help="build every phase again (default: keep what --out holds for the same inputs and continue "
                        "an interrupted build)")
    p.add_argument("--drafter-steps", type=int, help="train the drafter for this many steps (default: the "
                   "bundled pair's 2800; evaluated 4 times)")
    p.add_argument("--target", help="use this exported target directory (e.g. dflash/reference/assets/target) "
                   "instead of training a tokenizer and pretraining one: rebuilds the drafter only")
    p.add_argument("--answers-only", action="store_true",
                   help="stop after the target's answers (the drafter's training data) are written")
    args = p.parse_args(argv)
    cfg = BuildConfig.fast() if args.fast else BuildConfig()
    if args.drafter_steps is not None:
        if args.drafter_steps < 1:
            raise DFlashError(f"--drafter-steps: got {args.drafter_steps}, expected >= 1")
        cfg.drafter = dict(cfg.drafter, max_steps=args.drafter_steps,
                           eval_every=max(1, args.drafter_steps // 4))
    build(args.out, cfg, fresh=args.fresh, target=args.target, answers_only=args.answers_only)
    if args.install:
        install(Path(args.out))
        _log(f"installed into {PACKAGE_DIR}")
    return 0
