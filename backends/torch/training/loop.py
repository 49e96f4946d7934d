"""The run, top to bottom: set up, then `train_step` until the last step, then export and measure.

  1. the global batch of step s is a fixed slice of a seeded per-epoch permutation; rank r takes its share of it
  2. anchors of every sample come from a generator seeded by (seed, epoch, sample index)
  3. the loss is sum(w * slot loss) over the WHOLE global batch / sum(w) over the whole global batch (one
     all_reduce of the weight sum before the forward): the curve does not depend on world size or accumulation
  4. target features online (frozen target forward) or from a feature cache; one packed drafter forward per
     micro-batch; AdamW, clip, cosine LR
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash.errors import DFlashError
from dflash.spec import ABLATION_CONTEXT_MODES

from ..drafter import DFlashDrafter
from . import checkpoint as ckpt
from .attention import layer_rules
from .config import TrainConfig, TrainResult
from .data import collate, load_samples, sample_anchors_of, sample_weight, split_eval_prompts, step_indices
from .distributed import Dist, init_distributed
from .evaluate import evaluate, plot_curves
from .model import build_drafter, checkpoint_layers, wrap_for_parallel
from .objective import block_loss_sum, cosine_lr, default_gamma


@dataclass
class Run:
    """What every step needs, built once by `train`."""

    cfg: TrainConfig
    d: Dist
    device: str
    samples: list[dict]
    drafter: DFlashDrafter
    module: nn.Module  # PackedDrafter(drafter), possibly DDP / FSDP-wrapped: what the step calls
    fsdp: bool
    optimizer: torch.optim.Optimizer
    features: object  # OnlineFeatures | FeatureCache
    embed: nn.Module
    lm_head: nn.Module
    rules: tuple  # one LayerRule per draft layer
    gamma: float
    total: int
    autocast: object

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.d.world


def _log(cfg: TrainConfig, d: Dist, msg: str) -> None:
    if d.main and not cfg.quiet:
        print(msg, flush=True)


def train_step(run: Run, step: int) -> dict:
    """One optimiser step on the global batch of `step`; returns its log row (loss, accuracy, lr, grad norm)."""
    cfg, d = run.cfg, run.d
    b, accum = cfg.batch_size, cfg.grad_accum
    spec = run.drafter.spec
    # 1. this rank's share of the global batch, and its anchors
    epoch, idx = step_indices(step, len(run.samples), run.global_batch, cfg.seed)
    mine = idx[d.rank * b * accum:(d.rank + 1) * b * accum]
    anchors = [sample_anchors_of(run.samples[i], cfg.num_anchors, cfg.seed, epoch, i) for i in mine]
    # 2. the global normaliser: sum of loss weights over the whole global batch
    wsum = torch.tensor(sum(sample_weight(run.samples[i], a, v, spec.block_size, run.gamma)
                            for i, (a, v) in zip(mine, anchors)), dtype=torch.float64)
    wsum = float(d.sum(wsum).clamp(min=1e-6))
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
        if cfg.kl_weight > 0:
            feats, final = run.features.with_final(batch, ids)
        else:
            feats, final = run.features(batch, ids), None
        sync = m == accum - 1
        if run.fsdp:
            run.module.set_requires_gradient_sync(sync)
        with (run.module.no_sync() if ddp and not sync else contextlib.nullcontext()), run.autocast:
            loss_sum, correct, w = block_loss_sum(
                run.drafter, run.embed, run.lm_head, feats, ids, mask, a, v, block_size=spec.block_size,
                mask_token_id=spec.mask_token_id, gamma=run.gamma, forward=run.module, rules=run.rules,
                target_final=final, kl_weight=cfg.kl_weight, kl_top_k=cfg.kl_top_k)
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
    return {"step": step + 1, "epoch": epoch, "loss": float(stats[0] / wsum), "accuracy": float(stats[1] / wsum),
            "lr": lr, "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}


def too_few_samples(loaded: int, held: int, global_batch: int) -> str:
    """The error for a run left with fewer training samples than one global batch, naming the flag to change."""
    if held and loaded >= global_batch:
        return (f"--eval-holdout: holding out {held} of the {loaded} samples leaves {loaded - held} to train on, "
                f"fewer than the global batch of {global_batch}; hold out at most {loaded - global_batch} or pass "
                "held-out prompts with --eval-data FILE")
    return (f"--batch-size: global batch {global_batch} (batch x grad-accum x world) is larger than the {loaded} "
            "training samples")


def train(cfg: TrainConfig) -> TrainResult:
    from dflash import hub
    from dflash.tokenizer import eos_token_ids, load_tokenizer

    from ..target import load_target, resolve_device, resolve_dtype

    t_start = time.perf_counter()
    device = resolve_device(cfg.device)
    d = init_distributed(device)
    if device == "cuda":
        device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(device)
    out = Path(cfg.out)
    if d.main:
        from dflash.io import check_output_dir

        check_output_dir(out, "--out")  # created only once the inputs are validated: a refused run leaves nothing

    # --- target (frozen), tokenizer, data -------------------------------------------------------------------------
    if not cfg.target:
        raise DFlashError("--model: the target model is required")
    if cfg.draft_window is not None and cfg.draft_window < 1:
        raise DFlashError(f"--draft-window: got {cfg.draft_window}, expected >= 1 (context positions)")
    if not 0 <= cfg.kl_weight <= 1:
        raise DFlashError(f"--kl-weight: got {cfg.kl_weight}, expected 0..1")
    if cfg.context_mode not in ("kv",) + ABLATION_CONTEXT_MODES:
        raise DFlashError(f"--context-mode: got {cfg.context_mode!r}, expected kv, {' or '.join(ABLATION_CONTEXT_MODES)}")
    if cfg.kl_weight > 0 and cfg.features:
        raise DFlashError("--kl-weight: needs online target features (a feature cache holds no target logits); "
                          "drop --features or pass --kl-weight 0")
    target_dir = hub.resolve(cfg.target, "--model")
    target = load_target(target_dir, resolve_dtype("auto" if cfg.dtype == "auto" else cfg.dtype, device), device,
                         trust_remote_code=cfg.trust_remote_code)
    tokenizer = None
    with contextlib.suppress(DFlashError):
        tokenizer = load_tokenizer(target_dir, cfg.trust_remote_code)
    cache = None
    if cfg.samples is None and cfg.features:
        from ..features import FeatureCache

        cache = FeatureCache(cfg.features, device=device)
    loaded = load_samples(cfg, tokenizer, cache)
    samples, eval_prompts = split_eval_prompts(cfg, loaded, tokenizer)
    global_batch = cfg.batch_size * cfg.grad_accum * d.world
    if len(samples) < global_batch:
        raise DFlashError(too_few_samples(len(loaded), len(loaded) - len(samples), global_batch))
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * (len(samples) // global_batch)))

    # --- drafter, parallel wrapping, optimiser, feature source ------------------------------------------------------
    drafter = build_drafter(cfg, target, tokenizer)
    spec = drafter.spec
    if cfg.push_to_hub:
        spec.check_public("--push-to-hub")  # before the run, not after it
    if cache is not None and cache.target_layer_ids != spec.target_layer_ids:
        raise DFlashError(f"--features: cached layers {cache.target_layer_ids} differ from the drafter's "
                          f"target_layer_ids {spec.target_layer_ids}")
    drafter.to(device).float().requires_grad_(True)
    if cfg.activation_checkpointing:
        checkpoint_layers(drafter)
    module, fsdp = wrap_for_parallel(drafter, cfg.parallel, d, device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                  weight_decay=cfg.weight_decay)
    if cache is None:
        from ..features import OnlineFeatures

        features = OnlineFeatures(target, spec.target_layer_ids)
    else:
        features = cache
    # bf16 autocast: the default on CUDA; on CPU when asked (--dtype bfloat16: fast on CPUs with AMX / AVX512-BF16)
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.startswith("cuda"))
    run = Run(cfg, d, device, samples, drafter, module, fsdp, optimizer, features, target.get_input_embeddings(),
              target.get_output_embeddings(), layer_rules(spec, cfg.draft_window),
              cfg.gamma or default_gamma(spec.block_size), total,
              torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if bf16 else contextlib.nullcontext())

    # --- resume -------------------------------------------------------------------------------------------------------
    step, rows = ckpt.resume(out, cfg, module, optimizer, fsdp, d)
    if step:
        _log(cfg, d, f"resumed from {ckpt.checkpoint_dirs(out)[-1]} (step {step})")
    if d.main:
        (out / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2, default=str) + "\n")
        _log(cfg, d, f"training {spec.num_hidden_layers}-layer drafter, block {spec.block_size}, "
                     f"{len(samples)} samples, {total} steps x global batch {global_batch} (world {d.world})")
    log_path = out / "train_log.jsonl"
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r for r in rows if "tau" in r]
    log_file = open(log_path, "a") if d.main else None
    eos = eos_token_ids(target_dir, tokenizer) if tokenizer is not None else set()

    def log_row(row: dict) -> None:
        log_file.write(json.dumps(row) + "\n")
        log_file.flush()

    def run_eval(at: int) -> None:
        if not eval_prompts:
            return
        state = ckpt.full_model_state(module, drafter, fsdp)  # collective under FSDP
        if d.main:
            probe = DFlashDrafter(spec)
            probe.load_state_dict(state)
            show = cfg.progress and not cfg.quiet
            if not show:  # a bar says it itself; without one, a line, so a long evaluation does not look like a hang
                _log(cfg, d, f"eval step {at}: generating on {len(eval_prompts)} held-out prompts "
                             f"({cfg.eval_max_new_tokens} tokens each)")
            r = evaluate(target, probe.to(device), eval_prompts, cfg.eval_max_new_tokens, eos, cfg.draft_window,
                         progress=f"eval step {at}" if show else None)
            if hasattr(features, "capture"):
                features.capture.outputs.clear()
            evals.append({"step": at, **r})
            log_row(evals[-1])
            _log(cfg, d, f"eval step {at}: tau {r['tau']:.2f} over {r['cycles']} cycles")
        d.barrier()

    # --- the loop ------------------------------------------------------------------------------------------------------
    bar = None
    if d.main and cfg.progress and not cfg.quiet:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="train", dynamic_ncols=True)
    if cfg.eval_at_start and step == 0:
        run_eval(0)  # the untrained drafter's tau: the baseline the curve starts from
    module.train()
    while step < total:
        row = train_step(run, step)
        step += 1
        if d.main:
            losses.append(row["loss"])
            if step % cfg.log_every == 0 or step == total:
                log_row(dict(row, elapsed=time.perf_counter() - t_start))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.2f}", lr=f"{row['lr']:.1e}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            run_eval(step)
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            ckpt.save_checkpoint(out, step, module, optimizer, fsdp, d, cfg.keep_checkpoints)
    if bar is not None:
        bar.close()

    # --- final checkpoint, export, evaluation, plots -----------------------------------------------------------------
    saved = ckpt.checkpoint_dirs(out)
    if cfg.save_every and not (saved and saved[-1].name == f"step_{total:08d}"):
        ckpt.save_checkpoint(out, step, module, optimizer, fsdp, d, cfg.keep_checkpoints)
    draft_dir = out / "draft"
    ckpt.export_drafter(module, drafter, fsdp, d, draft_dir)
    _log(cfg, d, f"exported drafter to {draft_dir}")
    if eval_prompts and not (evals and evals[-1]["step"] == step):
        run_eval(step)
    if d.main:
        log_file.close()
        if cfg.plot:
            plot_curves(log_path, out / "curves.png")
        if cfg.push_to_hub:
            ckpt.push_to_hub(draft_dir, cfg.push_to_hub)
    if hasattr(features, "close"):
        features.close()
    d.barrier()
    return TrainResult(draft_dir=draft_dir, steps=step, losses=losses, evals=evals,
                       seconds=time.perf_counter() - t_start)
