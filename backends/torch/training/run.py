"""Everything a run needs before its first step, built once: the frozen target and its features, the data, the
drafter (possibly DDP / FSDP-wrapped), the optimiser, the autocast context and the held-out prompts."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash.core.extras.blas import cpu_has_native_bf16
from dflash.core.errors import DFlashError
from dflash.core.spec import ABLATION_CONTEXT_MODES

from ..drafter import DFlashDrafter
from .attention import layer_rules
from .config import TrainConfig
from .data import load_samples, split_eval_prompts
from .distributed import Dist, init_distributed
from .features import FeatureCache, OnlineFeatures
from .model import build_drafter, checkpoint_layers, restrict_vocab, wrap_for_parallel
from .objective import SOFT_LOSSES, default_gamma

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Run:
    """What every step (and every evaluation) needs."""

    cfg: TrainConfig
    d: Dist
    device: str
    target: PreTrainedModel  # frozen; its embedding and LM head are the drafter's too
    samples: list[dict]
    eval_prompts: list[list[int]]
    eos: set[int]
    drafter: DFlashDrafter
    module: Any  # PackedDrafter(drafter), possibly DDP / FSDP-wrapped (each wrapper's methods): what the step calls
    fsdp: bool
    optimizer: torch.optim.Optimizer
    features: OnlineFeatures | FeatureCache
    rules: tuple  # one LayerRule per draft layer
    gamma: float
    total: int  # optimiser steps of the whole run
    autocast: contextlib.AbstractContextManager

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.d.world

    @property
    def embed(self) -> nn.Module:
        return self.target.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.target.get_output_embeddings()

    def close(self) -> None:
        if hasattr(self.features, "close"):
            self.features.close()


def check_config(cfg: TrainConfig) -> None:
    """The flag combinations no run can use, refused before anything loads."""
    if not cfg.target:
        raise DFlashError("--model: the target model is required")
    if cfg.draft_window is not None and cfg.draft_window < 1:
        raise DFlashError(f"--draft-window: got {cfg.draft_window}, expected >= 1 (context positions)")
    if not 0 <= cfg.kl_weight <= 1:
        raise DFlashError(f"--kl-weight: got {cfg.kl_weight}, expected 0..1")
    if cfg.soft_loss not in SOFT_LOSSES:
        raise DFlashError(f"--soft-loss: got {cfg.soft_loss!r}, expected one of {', '.join(SOFT_LOSSES)}")
    if cfg.context_mode not in ("kv",) + ABLATION_CONTEXT_MODES:
        raise DFlashError(f"--context-mode: got {cfg.context_mode!r}, expected kv, {' or '.join(ABLATION_CONTEXT_MODES)}")
    if cfg.arch not in (None, "dflash", "dflash2"):
        raise DFlashError(f"--arch: got {cfg.arch!r}, expected dflash or dflash2")
    if cfg.arch == "dflash2" and cfg.context_mode != "kv":
        raise DFlashError(f"--arch dflash2: reads the target as K/V context only; drop --context-mode "
                          f"{cfg.context_mode}")
    if cfg.draft_vocab is not None and cfg.draft_vocab < 1:
        raise DFlashError(f"--draft-vocab: got {cfg.draft_vocab}, expected a positive number of tokens")
    if cfg.draft_vocab is not None and cfg.arch == "dflash2":
        raise DFlashError("--draft-vocab: a draft vocabulary is supported for DFlash drafters only (the DFlash2 "
                          "selector scores the whole vocabulary); drop one of --draft-vocab / --arch dflash2")


def too_few_samples(loaded: int, held: int, global_batch: int) -> str:
    """The error for a run left with fewer training samples than one global batch, naming the flag to change."""
    if held and loaded >= global_batch:
        return (f"--eval-holdout: holding out {held} of the {loaded} samples leaves {loaded - held} to train on, "
                f"fewer than the global batch of {global_batch}; hold out at most {loaded - global_batch} or pass "
                "held-out prompts with --eval-data FILE")
    return (f"--batch-size: global batch {global_batch} (batch x grad-accum x world) is larger than the {loaded} "
            "training samples")


def autocast_bf16_by_default(device: str) -> bool:
    """--dtype auto: bf16 autocast on CUDA, and on a CPU that multiplies bf16 in hardware (AMX, AVX512-BF16);
    float32 on other CPUs (AVX2 only), where bf16 is emulated and many times slower than float32."""
    return device.startswith("cuda") or (device.split(":")[0] == "cpu" and cpu_has_native_bf16())


def prepare(cfg: TrainConfig, target_dir: Path) -> Run:
    """The run of `cfg` for the target model in `target_dir` (a local directory: the application resolves hub ids)."""
    from dflash.core.model_files.tokenizer import eos_token_ids, load_tokenizer

    from ..target import load_target, resolve_device, resolve_dtype

    check_config(cfg)
    device = resolve_device(cfg.device)
    d = init_distributed(device)
    if device == "cuda":
        device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(device)

    # target (frozen), tokenizer, data
    target = load_target(target_dir, resolve_dtype(cfg.dtype, device), device, trust_remote_code=cfg.trust_remote_code)
    tokenizer = None
    with contextlib.suppress(DFlashError):
        tokenizer = load_tokenizer(target_dir, cfg.trust_remote_code)
    # features stored in bfloat16 reach the float32 drafter as float32 (autocast, where on, casts them back down)
    cache = FeatureCache(cfg.features, device=device, dtype=torch.float32) if cfg.samples is None and cfg.features \
        else None
    loaded = load_samples(cfg, tokenizer, cache)
    samples, eval_prompts = split_eval_prompts(cfg, loaded, tokenizer)
    global_batch = cfg.batch_size * cfg.grad_accum * d.world
    if len(samples) < global_batch:
        raise DFlashError(too_few_samples(len(loaded), len(loaded) - len(samples), global_batch))

    # drafter, parallel wrapping, optimiser, feature source
    drafter = build_drafter(cfg, target, tokenizer)
    if cfg.draft_vocab is not None:
        drafter = restrict_vocab(drafter, cfg.draft_vocab, samples, target.get_output_embeddings().weight,
                                 cfg.init_from)
    spec = drafter.spec
    if cache is not None and cache.target_layer_ids != spec.target_layer_ids:
        raise DFlashError(f"--features: cached layers {cache.target_layer_ids} differ from the drafter's "
                          f"target_layer_ids {spec.target_layer_ids}")
    if cache is not None and cfg.kl_weight > 0 and not 0 < cfg.kl_top_k <= cache.top_k:
        raise DFlashError(f"--kl-top-k: got {cfg.kl_top_k}, but {cfg.features} holds the target's top "
                          f"{cache.top_k} tokens; pass --kl-top-k {cache.top_k} or write the cache again with "
                          f"`python -m dflash.data cache-features --top-k {max(cfg.kl_top_k, 1)}`")
    drafter.to(device).float().requires_grad_(True)
    if spec.has_draft_vocab:  # the target's LM-head rows: frozen, as the target's head is
        drafter.lm_head.requires_grad_(False)
    if cfg.activation_checkpointing:
        checkpoint_layers(drafter)
    module, fsdp = wrap_for_parallel(drafter, cfg.parallel, d, device)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=cfg.lr,
                                  betas=(cfg.betas[0], cfg.betas[1]), weight_decay=cfg.weight_decay)
    features = OnlineFeatures(target, spec.target_layer_ids) if cache is None else cache
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and autocast_bf16_by_default(device))
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    return Run(cfg, d, device, target, samples, eval_prompts,
               eos_token_ids(target_dir, tokenizer) if tokenizer is not None else set(), drafter, module, fsdp,
               optimizer, features, layer_rules(spec, cfg.draft_window), cfg.gamma or default_gamma(spec.block_size),
               cfg.max_steps or max(1, math.ceil(cfg.epochs * (len(samples) // global_batch))), autocast)
