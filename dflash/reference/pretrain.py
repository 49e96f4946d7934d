"""Pretraining of the reference target: a small Qwen3 causal LM on the standard library's Python source.

nanoGPT-style and deliberately plain: one long token stream (train files + a few ChatML examples, each document
closed by an end token), random windows of `seq_len + 1` tokens drawn from it with a seeded generator, AdamW with
a linear warmup and a cosine decay, gradient clipping, a held-out loss every `eval_every` steps. The curve goes to a
JSONL log (one object per logged step) that docs/reference.md plots.

    python -m dflash.reference.pretrain --out runs/ref/target --tokenizer runs/ref/tokenizer --steps 1200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash import cli
from ..core.extras.plots import pyplot, save
from .corpus import SourceFile
from .prompts import KINDS, chat_example, functions

END_OF_DOCUMENT = "<|endoftext|>"


@dataclass
class PretrainConfig:
    # model (Qwen3)
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # optimisation
    steps: int = 2000
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    decay_fraction: float = 0.25
    max_seconds: float | None = 22 * 60  # wall-clock guard on the training loop (see Schedule)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    bf16: bool = True  # CPU autocast (AMX); weights and optimiser state stay float32
    compile: bool = True  # torch.compile the training step: ~2.5x faster on CPU, ~2 min to compile
    # data
    chat_fraction: float = 0.1  # ChatML examples (prompt in, whole function out), as a share of documents
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 8
    log_every: int = 10
    save_every: int = 100  # steps between resumable checkpoints (a rerun continues from the last one)
    threads: int = 2
    extra: dict = field(default_factory=dict)


def chatml(tokenizer, user: str, assistant: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}, {"role": "assistant",
                                                                             "content": assistant}], tokenize=False)


def documents(files: list[SourceFile], tokenizer, chat_fraction: float, seed: int) -> list[str]:
    """The pretraining documents: every file, plus ChatML examples cut from their functions, in a seeded order."""
    rng = random.Random(seed)
    docs = [f.text for f in files]
    if chat_fraction > 0:
        fns = [fn for f in files for fn in functions(f)]
        rng.shuffle(fns)
        n_chat = int(len(fns) * chat_fraction / (1 - chat_fraction)) if chat_fraction < 1 else len(fns)
        n_chat = min(n_chat, len(fns))
        for fn in fns[:n_chat]:
            ex = chat_example(fn, rng.choice(KINDS)) or chat_example(fn, "signature")
            if ex is not None:
                docs.append(chatml(tokenizer, *ex))
    rng.shuffle(docs)
    return docs


def token_stream(docs: list[str], tokenizer) -> torch.Tensor:
    """All documents tokenized and concatenated, each followed by the end-of-document token."""
    end = tokenizer.convert_tokens_to_ids(END_OF_DOCUMENT)
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(end)
    return torch.tensor(ids, dtype=torch.int32)


def batch(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    rows = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


class Schedule:
    """Warmup, a constant plateau, then a cosine decay over the last `decay_fraction` of the steps (WSD).

    With a wall-clock budget (`max_seconds`), a run on a slower or busier machine than planned decays early: once
    the plateau has used its share of the budget, the decay starts at once and follows the clock, ending when the
    budget is spent. On a machine fast enough for the planned steps nothing changes, so the build stays reproducible
    there; when the guard fires, the summary records at which step."""

    def __init__(self, cfg: "PretrainConfig"):
        self.cfg = cfg
        self.decay_start = int(cfg.steps * (1 - cfg.decay_fraction))
        self.guard_step: int | None = None
        self.guard_time: float | None = None

    def lr(self, step: int, elapsed: float = 0.0) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        if self.guard_time is not None:
            assert cfg.max_seconds is not None  # (the guard runs under a time limit)
            t = (elapsed - self.guard_time) / max(1e-9, cfg.max_seconds - self.guard_time)
        elif step < self.decay_start:
            return cfg.lr
        else:
            t = (step - self.decay_start) / max(1, cfg.steps - self.decay_start)
        t = min(1.0, max(0.0, t))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def done(self, step: int, elapsed: float) -> bool:
        """Check the clock before each step; True when the run is over."""
        cfg = self.cfg
        if step >= cfg.steps:
            return True
        if not cfg.max_seconds or step == 0:
            return False
        if self.guard_time is None and step < self.decay_start and \
                elapsed > (1 - cfg.decay_fraction) * cfg.max_seconds:
            self.guard_step, self.guard_time = step, elapsed
        return self.guard_time is not None and elapsed >= cfg.max_seconds


def make_model(cfg: PretrainConfig, tokenizer, vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    end = tokenizer.convert_tokens_to_ids(END_OF_DOCUMENT)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=[tokenizer.eos_token_id, end], pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        initializer_range=0.02)
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, cfg: PretrainConfig) -> float:
    """Mean loss over fixed windows of the held-out stream (the same windows at every evaluation)."""
    model.eval()
    g = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = batch(stream, cfg.batch_size, cfg.seq_len, g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def pretrain(train_files: list[SourceFile], heldout_files: list[SourceFile], tokenizer, cfg: PretrainConfig,
             out_dir: str | Path, log_path: str | Path | None = None, vocab_size: int | None = None,
             progress: bool = True) -> dict:
    """Train the target and save it (float32; export converts to float16). Returns the cost summary."""
    from dflash.core.io import atomic_write_text

    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    vocab_size = vocab_size or len(tokenizer) + 8  # spare rows past the tokenizer: room for the mask token
    train = token_stream(documents(train_files, tokenizer, cfg.chat_fraction, cfg.seed), tokenizer)
    heldout = token_stream([f.text for f in heldout_files], tokenizer)
    model = make_model(cfg, tokenizer, vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                            fused=True)
    g = torch.Generator().manual_seed(cfg.seed)
    checkpoint = Path(out_dir).parent / f".{Path(out_dir).name}.checkpoint.pt"
    state = _resume(checkpoint, cfg, model, opt, g)
    log = open(log_path, "a" if state and log_path and Path(log_path).exists() else "w") if log_path else None
    summary = {"params": n_params, "train_tokens_in_corpus": len(train), "heldout_tokens": len(heldout),
               "config": asdict(cfg)}
    if progress:
        print(f"target: {n_params / 1e6:.2f}M params, corpus {len(train)} train / {len(heldout)} held-out tokens, "
              f"{cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len}", flush=True)

    def loss_of(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    step_loss = torch.compile(loss_of) if cfg.compile else loss_of  # evaluation stays eager (no recompile)
    model.train()
    sched = Schedule(cfg)
    step, seen, t_train = 0, 0, time.time()
    if state:
        step, seen, t_train = state["step"], state["seen"], time.time() - state["seconds"]
        sched.guard_step, sched.guard_time = state["guard_step"], state["guard_time"]
        if progress:
            print(f"target: resumed from {checkpoint} (step {step})", flush=True)
    while not sched.done(step, time.time() - t_train):
        lr = sched.lr(step, time.time() - t_train)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(train, cfg.batch_size, cfg.seq_len, g)
        loss = step_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        opt.step()
        seen += x.numel()
        last = step == cfg.steps - 1 or (sched.guard_time is not None and cfg.max_seconds is not None
                                      and time.time() - t_train >= cfg.max_seconds)
        if step % cfg.log_every == 0 or last or (cfg.eval_every and step % cfg.eval_every == 0):
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr, 6),
                   "grad_norm": round(gnorm, 3), "tokens": seen, "seconds": round(time.time() - t_train, 1)}
            if cfg.eval_every and (step % cfg.eval_every == 0 or last):
                rec["heldout_loss"] = round(evaluate(model, heldout, cfg), 4)
            rec["tokens_per_second"] = round(seen / max(time.time() - t_train, 1e-9), 1)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if progress:
                print(json.dumps(rec), flush=True)
        step += 1
        if cfg.save_every and step % cfg.save_every == 0:
            _save(checkpoint, cfg, model, opt, g, dict(step=step, seen=seen, seconds=time.time() - t_train,
                                                       guard_step=sched.guard_step, guard_time=sched.guard_time))
    train_seconds = time.time() - t_train
    out_dir = Path(out_dir)
    model.eval()
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    summary.update(train_seconds=round(train_seconds, 1), total_seconds=round(time.time() - t0, 1),
                   tokens_seen=seen, steps=step, time_guard_step=sched.guard_step, final_loss=rec["loss"],
                   final_heldout_loss=rec.get("heldout_loss"))
    atomic_write_text(out_dir / "pretrain_summary.json", json.dumps(summary, indent=2) + "\n")
    checkpoint.unlink(missing_ok=True)
    if log:
        log.close()
    return summary


def _save(path: Path, cfg: PretrainConfig, model, opt, generator, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": json.loads(json.dumps(asdict(cfg))), "model": model.state_dict(), "opt": opt.state_dict(),
                "generator": generator.get_state(), **state}, tmp)
    os.replace(tmp, path)  # a kill while saving leaves the previous checkpoint whole


def _resume(path: Path, cfg: PretrainConfig, model, opt, generator) -> dict | None:
    """The interrupted run's state, loaded into model / opt / generator, if it was made with this config."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["config"] != json.loads(json.dumps(asdict(cfg))):
        return None
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    generator.set_state(saved["generator"])
    return saved


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from .corpus import source_files, split

    p = cli.Parser(prog="python -m dflash.reference.pretrain", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (dflash.reference.tiny.train_tokenizer)")
    p.add_argument("--out", required=True)
    p.add_argument("--log", help="JSONL training curve")
    for f in ("steps", "batch_size", "seq_len", "hidden_size", "num_hidden_layers", "intermediate_size", "seed"):
        p.add_argument("--" + f.replace("_", "-"), type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--limit-bytes", type=int, help="use a deterministic subset of the corpus")
    args = p.parse_args(argv)
    cfg = PretrainConfig()
    for k, v in vars(args).items():
        if hasattr(cfg, k) and v is not None:
            setattr(cfg, k, v)
    cfg.bf16, cfg.compile = not args.no_bf16, not args.no_compile
    train, heldout = split(source_files(limit_bytes=args.limit_bytes))
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    print(json.dumps(pretrain(train, heldout, tok, cfg, args.out, args.log)))
    if args.log:
        plot_curve(args.log, Path(args.log).with_suffix(".png"))
    return 0



def plot_curve(log_path: str | Path, png: str | Path) -> None:
    """Training and held-out loss against tokens seen."""
    plt = pyplot("reference pretraining plot")
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    ev = [r for r in rows if "heldout_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], label="train (batch)")
    ax.plot([r["tokens"] for r in ev], [r["heldout_loss"] for r in ev], marker="o", label="held-out files")
    ax.set(xlabel="tokens seen", ylabel="cross-entropy (nats/token)", title="reference target pretraining")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, png, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
