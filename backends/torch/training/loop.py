"""The run, top to bottom: prepare, then `train_step` until the last step, then export and measure.

  1. the global batch of step s is a fixed slice of a seeded per-epoch permutation; rank r takes its share of it
  2. anchors of every sample come from a generator seeded by (seed, epoch, sample index)
  3. the loss is sum(w * slot loss) over the WHOLE global batch / sum(w) over the whole global batch (one
     all_reduce of the weight sum before the forward): the curve does not depend on world size or accumulation
  4. target features (and the soft label's target distribution) online from a frozen target forward, or from a
     feature cache; one packed drafter forward per micro-batch; AdamW, clip, cosine LR
The parts: run.py (what a step needs), data.py (order, anchors), objective.py (the loss), checkpoint.py (save,
resume, export), evaluate.py (tau with the real loop), log.py (console, bar, train_log.jsonl).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from .config import TrainConfig, TrainResult
from .data import collate, sample_anchors_of, sample_weight, step_indices
from .evaluate import evaluate_run
from .features import FeatureCache, OnlineFeatures
from .log import RunLog
from .objective import block_loss_sum, cosine_lr
from .run import Run, prepare


def train_step(run: Run, step: int) -> dict:
    """One optimiser step on the global batch of `step`; returns its log row (the batch's answer tokens, loss,
    accuracy, lr, grad norm)."""
    cfg, d = run.cfg, run.d
    b, accum = cfg.batch_size, cfg.grad_accum
    spec = run.drafter.spec
    # 1. this rank's share of the global batch, and its anchors
    epoch, idx = step_indices(step, len(run.samples), run.global_batch, cfg.seed)
    mine = idx[d.rank * b * accum:(d.rank + 1) * b * accum]
    anchors = [sample_anchors_of(run.samples[i], cfg.num_anchors, cfg.seed, epoch, i) for i in mine]
    # 2. the global normaliser: sum of loss weights over the whole global batch
    vocab = run.drafter.t2d.cpu() if spec.has_draft_vocab else None
    # (and the global batch's answer tokens, for the log, in the same all_reduce)
    mine_sums = torch.tensor([sum(sample_weight(run.samples[i], a, v, spec.block_size, run.gamma, vocab)
                                  for i, (a, v) in zip(mine, anchors)),
                              sum(sum(run.samples[i]["loss_mask"]) for i in mine)], dtype=torch.float64)
    global_sums = d.sum(mine_sums)
    wsum, answer_tokens = float(global_sums[0].clamp(min=1e-6)), int(global_sums[1])
    lr = cosine_lr(step, run.total, cfg.lr, cfg.warmup_ratio, cfg.min_lr_ratio)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    # 3. forward / backward per micro-batch
    stats = torch.zeros(3, dtype=torch.float64)  # loss sum, correct sum, weight sum
    ddp = isinstance(run.module, nn.parallel.DistributedDataParallel)
    for m in range(accum):
        part = slice(m * b, (m + 1) * b)
        batch = [run.samples[i] for i in mine[part]]
        ids, mask, a, v = collate(batch, anchors[part], run.device)
        final = top = None
        if cfg.kl_weight > 0 and isinstance(run.features, OnlineFeatures):
            feats, final = run.features.with_final(batch, ids)
        elif cfg.kl_weight > 0 and isinstance(run.features, FeatureCache):
            feats, top = run.features.with_top(batch, ids, cfg.kl_top_k)
        else:
            feats = run.features(batch, ids)
        sync = m == accum - 1
        if run.fsdp:
            run.module.set_requires_gradient_sync(sync)
        with (run.module.no_sync() if ddp and not sync else contextlib.nullcontext()), run.autocast:
            loss_sum, correct, w = block_loss_sum(
                run.drafter, run.embed, run.lm_head, feats, ids, mask, a, v, block_size=spec.block_size,
                mask_token_id=spec.mask_token_id, gamma=run.gamma, forward=run.module, rules=run.rules,
                target_final=final, kl_weight=cfg.kl_weight, kl_top_k=cfg.kl_top_k, cached_top=top,
                soft_loss=cfg.soft_loss,
                selector_weight=cfg.selector_loss_weight)
            # DDP / FSDP average gradients over ranks: scale by world so the result is sum / global weight
            loss = loss_sum * (d.world / wsum)
            if not loss.requires_grad:  # no supervised slot in this micro-batch: still join the reduction
                loss = loss + sum(p.sum() * 0 for p in run.module.parameters())
            loss.backward()
        stats += torch.stack([x.detach().double().cpu() for x in (loss_sum, correct, w)])
    # 4. clip, step
    grad_norm = torch.nn.utils.clip_grad_norm_(run.module.parameters(), cfg.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    stats = d.sum(stats)
    return {"step": step + 1, "epoch": epoch, "answer_tokens": answer_tokens,
            "loss": float(stats[0] / wsum), "accuracy": float(stats[1] / wsum),
            "lr": lr, "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}


def train(cfg: TrainConfig, target_dir: str | os.PathLike | None = None) -> TrainResult:
    """Train a drafter for the target in `target_dir` (default: cfg.target as a local directory) and export it to
    cfg.out/draft. Resumes from the newest checkpoint in cfg.out. Ctrl-C or SIGTERM (one process) finishes the
    current step, writes a checkpoint and raises KeyboardInterrupt."""
    started = time.perf_counter()
    run = prepare(cfg, Path(target_dir or cfg.target))
    d, out, spec = run.d, Path(cfg.out), run.drafter.spec
    # what fixes the sample order and the schedule: a checkpoint of a run that differs in any is refused
    order = {"samples": len(run.samples), "global_batch": run.global_batch, "steps": run.total, "seed": cfg.seed,
             "data": str(cfg.data), "data_rows": str(cfg.data_rows), "lr": cfg.lr}
    save = lambda at: ckpt.save_checkpoint(out, at, run.module, run.optimizer, run.fsdp, d, cfg.keep_checkpoints,
                                           order)

    step, rows = ckpt.resume(out, cfg, run.module, run.optimizer, run.fsdp, d, order)
    log = RunLog(cfg, d, out, rows, total=run.total, started=started)
    log.say(f"run directory {out.resolve()}: checkpoints, train_log.jsonl, the exported drafter in draft/")
    if step:
        log.say(f"resumed from {ckpt.checkpoint_dirs(out)[-1]} (step {step})")
    if d.main:
        (out / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2, default=str) + "\n")
    log.say(f"training {spec.num_hidden_layers}-layer drafter, block {spec.block_size}, {len(run.samples)} samples, "
            f"{run.total} steps x global batch {run.global_batch} (world {d.world})")
    if cfg.eval_at_start and step == 0:
        evaluate_run(run, log, 0)  # the untrained drafter's tau: the baseline the curve starts from

    run.module.train()
    with ckpt.StopRequests(enabled=d.world == 1) as stop:
        while step < run.total and not stop.signal:
            log.step(train_step(run, step))
            step += 1
            due = cfg.eval_every and step % cfg.eval_every == 0 or step in (cfg.eval_at or ())
            if due and step < run.total and not stop.signal:
                evaluate_run(run, log, step)
            if cfg.save_every and step % cfg.save_every == 0 and step < run.total:
                save(step)
        log.end_of_steps()
        if stop.signal and step < run.total:
            if not ckpt.saved_at(out, step):
                save(step)  # (a second signal while it is written leaves the previous checkpoint the newest)
            log.say(f"stopped by {stop.signal} at step {step} of {run.total}: checkpoint "
                    f"{ckpt.checkpoint_dirs(out)[-1]}; rerun the same command to resume from it")
            log.close()
            run.close()
            raise KeyboardInterrupt

    if cfg.save_every and not ckpt.saved_at(out, run.total):
        save(step)
    draft_dir = out / "draft"
    ckpt.export_drafter(run.module, run.drafter, run.fsdp, d, draft_dir)
    log.say(f"exported drafter to {draft_dir}")
    if cfg.eval_at_end and run.eval_prompts and not log.evaluated_at(step):
        log.say(f"final evaluation: {len(run.eval_prompts)} held-out prompts x {cfg.eval_max_new_tokens} tokens "
                "through the speculative loop (--no-eval-at-end skips it)")
        evaluate_run(run, log, step)
    log.close()
    run.close()
    d.barrier()
    return TrainResult(draft_dir=draft_dir, steps=step, losses=log.losses, evals=log.evals,
                       seconds=time.perf_counter() - started)
