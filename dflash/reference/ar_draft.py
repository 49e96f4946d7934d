"""A small autoregressive draft model for the reference target: the draft that transformers' assisted generation
and mlx-lm's speculative decoding need, so `python -m dflash.bench` can compare DFlash with them on equal terms.

It is distilled from the same target on the same data as the DFlash drafter: the target's own greedy answers to the
training prompts (the build's answers_chat.jsonl as ChatML conversations and answers_completion.jsonl as plain
completions, `python -m dflash.data regenerate` format; an older build's answers.jsonl counts as chat). The model is a
Qwen3 of the
target's shape and tokenizer with `num_layers` decoder layers; its embedding, final norm and LM head start as copies
of the target's and its layers as copies of evenly spaced target layers, then everything is trained on the target's
next-token distribution (KL to the target's softmax over every position of prompt + answer) plus cross-entropy on
the answer tokens, with AdamW, warmup and cosine decay. Float16 safetensors, loadable by transformers and mlx-lm.

    python -m dflash.reference build-ar-draft               # from runs/reference (answers regenerated if absent)
    python -m dflash.reference build-ar-draft --install     # ... and store it in the package assets
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash import cli
from dflash.core.errors import DFlashError

from . import ASSETS, TARGET_DIR

AR_DRAFT_DIR = ASSETS / "ar_draft"
NEEDED = ("config.json", "model.safetensors", "tokenizer.json")
ASSET_BUDGET_BYTES = 40 * 10**6  # the package's reference assets stay below this


@dataclass
class ARDraftConfig:
    num_layers: int = 2
    steps: int = 300
    batch_size: int = 8
    max_length: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kd_weight: float = 1.0  # KL(target || draft) on every position; 0 = hard labels only
    ce_weight: float = 1.0  # cross-entropy on the answer tokens (the target's greedy choices)
    heldout_fraction: float = 0.05
    seed: int = 0
    threads: int = 2
    max_seconds: float | None = 20 * 60  # stop early (and say so) past this wall time
    log_every: int = 25


def _log(msg: str) -> None:
    print(f"[ar-draft] {msg}", flush=True)


def complete(directory: Path) -> bool:
    return all((Path(directory) / n).is_file() for n in NEEDED)


def cache_root() -> Path:
    base = os.environ.get("DFLASH_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "dflash")
    return Path(base).expanduser()


def target_fingerprint(target_dir: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(Path(target_dir) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def cache_dir_for(target_dir: Path = TARGET_DIR) -> Path:
    return cache_root() / "reference" / f"ar_draft-{target_fingerprint(target_dir)}"


def ensure_ar_draft(build_dir: str | Path = "runs/reference") -> Path:
    """The reference target's AR draft: the packaged one, else the cached one, else built now into the cache."""
    from . import reference_dirs

    if complete(AR_DRAFT_DIR):
        return AR_DRAFT_DIR
    target, _ = reference_dirs()
    cached = cache_dir_for(target)
    if complete(cached):
        return cached
    _log(f"no packaged AR draft; building one into {cached} (python -m dflash.reference build-ar-draft; minutes)")
    build(target, Path(build_dir), cached, ARDraftConfig())
    return cached


# ---- data ------------------------------------------------------------------------------------------------------------
# the build's plain-completion template (dflash/reference/build.py): the prompt as is, no markers
COMPLETION_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def answer_files(build_dir: Path) -> list[tuple[Path, str]]:
    """(answers file, format) of a reference build, format 'chat' or 'completion'."""
    found = [(build_dir / f"answers_{fmt}.jsonl", fmt) for fmt in ("chat", "completion")]
    found = [(p, fmt) for p, fmt in found if p.is_file()]
    if not found and (build_dir / "answers.jsonl").is_file():
        found = [(build_dir / "answers.jsonl", "chat")]
    return found


def answers_for(target_dir: Path, build_dir: Path) -> list[tuple[Path, str]]:
    """The build's answers, regenerated from the target (same prompts, same settings as the build) if absent."""
    found = answer_files(build_dir)
    if found:
        return found
    from . import build as B
    from .corpus import source_files, split
    from .prompts import training_prompts

    cfg = B.BuildConfig()
    formats = tuple(getattr(cfg, "answer_formats", ("chat",)))
    _log(f"no answers in {build_dir}: regenerating the target's answers to the {cfg.train_prompts} training prompts "
         f"({', '.join(formats)})")
    train_files, _ = split(source_files(limit_bytes=cfg.limit_bytes))
    prompts = training_prompts(train_files, limit=cfg.train_prompts, seed=cfg.seed,
                               max_chars=cfg.train_prompt_max_chars)
    build_dir.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        target = target_dir
        if fmt == "completion":
            target = build_dir / "completion_target"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(target_dir, target)
            (target / "chat_template.jinja").write_text(COMPLETION_TEMPLATE)
        B.regenerate(target, prompts, build_dir / f"answers_{fmt}.jsonl", cfg.answer_tokens)
    return answer_files(build_dir)


def load_answer_samples(target_dir: Path, files: list[tuple[Path, str]], max_length: int) -> list[dict]:
    """Tokenised samples (input_ids, loss_mask on the answer) of every answers file, each with its own template."""
    from dflash.core.training.datasets import load_samples
    from dflash.core.model_files.tokenizer import load_tokenizer

    samples = []
    for path, fmt in files:
        tok = load_tokenizer(target_dir)
        if fmt == "completion":
            tok.chat_template = COMPLETION_TEMPLATE
        samples += load_samples(path, tok, max_length=max_length)
    return samples


# ---- model -----------------------------------------------------------------------------------------------------------
def make_draft(target, num_layers: int, seed: int):
    """A Qwen3 of the target's shape with `num_layers` layers, initialised from the target."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(target.config)
    n = cfg.num_hidden_layers
    if not 1 <= num_layers <= n:
        raise DFlashError(f"--layers: got {num_layers}, expected 1..{n} (the target's layer count)")
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ids = [round(i * (n - 1) / max(num_layers - 1, 1)) for i in range(num_layers)] if num_layers > 1 else [0]
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        for j, i in enumerate(ids):
            draft.model.layers[j].load_state_dict(target.model.layers[i].state_dict())
    return draft, ids


def _batches(samples: list[dict], batch_size: int, rng: random.Random):
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        for k in range(0, len(order) - batch_size + 1, batch_size):
            yield [samples[i] for i in order[k:k + batch_size]]


def _collate(rows: list[dict], pad_id: int):
    import torch

    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    valid = torch.zeros((len(rows), n), dtype=torch.bool)
    answer = torch.zeros((len(rows), n), dtype=torch.bool)
    for b, r in enumerate(rows):
        m = len(r["input_ids"])
        ids[b, :m] = torch.tensor(r["input_ids"])
        valid[b, :m] = True
        answer[b, :m] = torch.tensor(r["loss_mask"], dtype=torch.bool)
    # position t predicts token t+1: a prediction counts when both t and t+1 are real tokens
    pred = valid[:, :-1] & valid[:, 1:]
    return ids, pred, answer[:, 1:] & pred


def _losses(draft, target, ids, pred, answer, cfg: ARDraftConfig):
    import torch
    import torch.nn.functional as F

    attn = torch.ones_like(ids)
    with torch.no_grad():
        t_logits = target(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    d_logits = draft(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    d_logp = F.log_softmax(d_logits[pred], dim=-1)
    t_logp = F.log_softmax(t_logits[pred], dim=-1)
    kd = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
    labels = ids[:, 1:]
    ce = F.cross_entropy(d_logits[answer], labels[answer]) if answer.any() else d_logits.new_zeros(())
    agree = (d_logits[answer].argmax(-1) == t_logits[answer].argmax(-1)).float().mean() if answer.any() else None
    return cfg.kd_weight * kd + cfg.ce_weight * ce, kd, ce, agree


def train(target_dir: Path, answers: list[tuple[Path, str]], out_dir: Path, cfg: ARDraftConfig) -> dict:
    """Distil the draft; save it (float16) into out_dir; return the summary (also out_dir/ar_draft.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.core.io import atomic_directory, atomic_write_text

    torch.set_num_threads(cfg.threads)
    t_all = time.time()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval().requires_grad_(False)
    samples = load_answer_samples(target_dir, answers, cfg.max_length)
    rng = random.Random(cfg.seed)
    rng.shuffle(samples)
    n_held = max(1, int(len(samples) * cfg.heldout_fraction)) if len(samples) > 1 else 0
    held, train_set = samples[:n_held], samples[n_held:] or samples
    draft, layer_ids = make_draft(target, cfg.num_layers, cfg.seed)
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batches = _batches(train_set, min(cfg.batch_size, len(train_set)), rng)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def evaluate() -> dict:
        if not held:
            return {}
        draft.eval()
        tot = {"kd": 0.0, "ce": 0.0, "agree": 0.0}
        with torch.no_grad():
            for k in range(0, len(held), cfg.batch_size):
                ids, pred, answer = _collate(held[k:k + cfg.batch_size], pad)
                _, kd, ce, agree = _losses(draft, target, ids, pred, answer, cfg)
                w = len(held[k:k + cfg.batch_size]) / len(held)
                tot["kd"] += kd.item() * w
                tot["ce"] += ce.item() * w
                tot["agree"] += (agree.item() if agree is not None else 0.0) * w
        draft.train()
        return {f"heldout_{k}": round(v, 4) for k, v in tot.items()}

    curve, t_train, step, stopped_early = [], time.time(), 0, False
    before = evaluate()
    _log(f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, layers from target {layer_ids}; "
         f"{len(train_set)} train / {len(held)} held-out answers; before training: {before}")
    for step in range(cfg.steps):
        if cfg.max_seconds and time.time() - t_train > cfg.max_seconds:
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, pred, answer = _collate(next(batches), pad)
        loss, kd, ce, agree = _losses(draft, target, ids, pred, answer, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rec = {"step": step, "loss": round(loss.item(), 4), "kd": round(kd.item(), 4), "ce": round(ce.item(), 4),
                   "agree": round(agree.item(), 4) if agree is not None else None, "lr": round(lr_at(step), 6),
                   "seconds": round(time.time() - t_train, 1)}
            curve.append(rec)
            _log(json.dumps(rec))
    steps_done = step + (0 if stopped_early else 1)
    train_seconds = time.time() - t_train
    after = evaluate()
    _log(f"after {steps_done} steps ({train_seconds:.0f} s): {after}")
    draft.eval()
    with atomic_directory(out_dir) as tmp:
        draft.to(torch.float16).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        gc = draft.generation_config
        gc.eos_token_id = target.generation_config.eos_token_id
        gc.pad_token_id = pad
        gc.do_sample = False
        gc.save_pretrained(str(tmp))
    summary = {"config": asdict(cfg), "target": str(target_dir), "answers": [[str(p), fmt] for p, fmt in answers],
               "params": sum(p.numel() for p in draft.parameters()), "layers_from_target": layer_ids,
               "train_samples": len(train_set), "heldout_samples": len(held), "steps": steps_done,
               "stopped_early_by_max_seconds": stopped_early, "train_seconds": round(train_seconds, 1),
               "total_seconds": round(time.time() - t_all, 1), "before": before, "after": after, "curve": curve,
               "size_bytes": sum(f.stat().st_size for f in Path(out_dir).iterdir() if f.is_file())}
    atomic_write_text(Path(out_dir) / "ar_draft.json", json.dumps(summary, indent=1) + "\n")
    return summary


def build(target_dir: Path, build_dir: Path, out_dir: Path, cfg: ARDraftConfig) -> dict:
    answers = answers_for(Path(target_dir), Path(build_dir))
    return train(Path(target_dir), answers, Path(out_dir), cfg)


def assets_bytes(exclude: str | None = None) -> int:
    return sum(f.stat().st_size for d in ASSETS.iterdir() if d.is_dir() and d.name != exclude
               for f in d.rglob("*") if f.is_file()) if ASSETS.is_dir() else 0


def install(src: Path) -> None:
    """Copy into the package assets, only if all reference assets stay within ASSET_BUDGET_BYTES."""
    size = sum(f.stat().st_size for f in Path(src).iterdir() if f.is_file())
    total = assets_bytes(exclude="ar_draft") + size
    if total > ASSET_BUDGET_BYTES:
        raise DFlashError(f"--install: the reference assets would weigh {total / 1e6:.1f} MB with the AR draft "
                          f"(budget {ASSET_BUDGET_BYTES / 1e6:.0f} MB); keep it in the cache instead "
                          f"({cache_dir_for()})")
    shutil.rmtree(AR_DRAFT_DIR, ignore_errors=True)
    shutil.copytree(src, AR_DRAFT_DIR)
    _log(f"installed into {AR_DRAFT_DIR}: reference assets now {total / 1e6:.1f} MB")


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.reference build-ar-draft", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target directory (default: the packaged reference target)")
    p.add_argument("--build-dir", default="runs/reference", help="reference build directory holding answers_*.jsonl "
                   "(regenerated there if absent; default: runs/reference)")
    p.add_argument("--answers", action="append", default=[], help="the target's answers as ChatML conversations "
                   "(JSONL, regenerate format; repeatable); with --completion-answers, overrides --build-dir")
    p.add_argument("--completion-answers", action="append", default=[], help="the target's answers to plain "
                   "completion prompts (rendered without chat markers; repeatable)")
    p.add_argument("--out", help="output directory (default: the cache, see --install)")
    p.add_argument("--install", action="store_true", help="copy into dflash/reference/assets/ar_draft (if the "
                   "assets stay <= 40 MB)")
    p.add_argument("--layers", type=int, default=ARDraftConfig.num_layers)
    p.add_argument("--steps", type=int, default=ARDraftConfig.steps)
    p.add_argument("--batch-size", type=int, default=ARDraftConfig.batch_size)
    p.add_argument("--lr", type=float, default=ARDraftConfig.lr)
    p.add_argument("--threads", type=int, default=ARDraftConfig.threads)
    p.add_argument("--max-seconds", type=float, default=ARDraftConfig.max_seconds)
    p.add_argument("--seed", type=int, default=ARDraftConfig.seed)
    args = p.parse_args(argv)
    if args.target:
        target = Path(args.target)
        if not complete(target) and not (target / "config.json").is_file():
            raise DFlashError(f"--target: {target} is not a model directory")
    else:
        from . import reference_dirs

        target = reference_dirs()[0]
    cfg = ARDraftConfig(num_layers=args.layers, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                        threads=args.threads, max_seconds=args.max_seconds, seed=args.seed)
    out = Path(args.out) if args.out else cache_dir_for(target)
    if args.answers or args.completion_answers:
        files = [(Path(a), "chat") for a in args.answers] + [(Path(a), "completion") for a in args.completion_answers]
        for path, _ in files:
            if not path.is_file():
                raise DFlashError(f"--answers: {path} does not exist")
        summary = train(target, files, out, cfg)
    else:
        summary = build(target, Path(args.build_dir), out, cfg)
    _log(f"saved {out} ({summary['size_bytes'] / 1e6:.1f} MB, {summary['steps']} steps, "
         f"{summary['train_seconds']} s); held-out top-1 agreement with the target "
         f"{summary['before'].get('heldout_agree')} -> {summary['after'].get('heldout_agree')}")
    if args.install:
        install(out)
    return 0
