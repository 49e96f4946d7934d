"""Every knob of a training run: the flags of `python -m dflash.train` and the keys of its --config file. No torch
import, so the CLI parses (and --help answers) before any framework loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    # what to train on
    target: str = ""  # target model directory (or hub id)
    data: str | None = None  # JSONL / datasets dir of chat or tokenised rows, or an answers shard directory
    data_rows: str | None = None  # "START:STOP": only these rows of an answers shard directory
    features: str | None = None  # a cache-features directory (samples + offline features); replaces --data
    out: str = "runs/dflash"
    samples: list | None = field(default=None, repr=False)  # in-process: [{"input_ids", "loss_mask"}]
    enable_thinking: bool | None = None
    max_length: int = 3072
    # drafter
    arch: str | None = None  # dflash | dflash2 (None: dflash for a new drafter, the drafter's own with --init-from)
    init_from: str | None = None  # an existing drafter directory; otherwise a new one shaped from the target
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    context_mode: str = "kv"  # kv: DFlash; none / input: the ablation drafters of dflash.core.spec (torch only)
    init_layers: str = "target-first"  # copy the target's first decoder layers ("target": its last; "random": HF init)
    draft_vocab: int | None = None  # a draft vocabulary of the N most frequent answer tokens (dflash.core.draft_vocab)
    # DFlash2: the two-tap dynamic convolutions and the candidate selector (new drafter)
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # attention as inference will run it: the draft context window (--draft-window) and the config's sliding
    # layers (layer_types + sliding_window; is_causal)
    draft_window: int | None = None
    sliding_window: int | None = None  # new drafter: declare sliding layers with this window ...
    layer_types: list[str] | None = None  # ... of these types per layer (default: every layer sliding)
    is_causal: bool | None = None  # sliding layers causal inside the block (None: the config rule, causal)
    # objective
    num_anchors: int = 512
    gamma: float | None = None
    kl_weight: float = 0.0  # blend each slot's CE with CE against the target's full distribution (0: the paper)
    kl_top_k: int = 64  # soft label = the target's top-k tokens, renormalised (0: the whole vocabulary)
    soft_loss: str = "kl"  # the soft label's term: kl (cross-entropy against it) or lk (-log acceptance, 1 - TV)
    selector_loss_weight: float = 1.0  # DFlash2: weight of the selector's teacher-forced top-k cross-entropy
    # optimisation
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    epochs: float = 6.0
    max_steps: int | None = None
    batch_size: int = 1  # sequences per micro-batch per rank
    grad_accum: int = 1  # micro-batches per step; global batch = batch_size * grad_accum * world size
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere; bfloat16: autocast on any device
    activation_checkpointing: bool = False
    parallel: str = "ddp"  # ddp | fsdp (only used with more than one process)
    device: str = "auto"
    trust_remote_code: bool = False
    # checkpoints
    save_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = True
    # evaluation: real acceptance length of the speculative loop on held-out prompts
    eval_every: int = 0
    eval_at: list[int] | None = None  # also evaluate after these steps (a learning curve's points)
    eval_at_start: bool = False  # also measure the untrained drafter (a full evaluation before step 1)
    eval_at_end: bool = True  # measure the exported drafter (with held-out prompts; announced when it starts)
    eval_data: str | None = None
    eval_prompts: list | None = field(default=None, repr=False)  # in-process: lists of prompt ids
    eval_holdout: int = 0  # hold out this many training samples and evaluate on their prompts
    eval_max_prompts: int = 8
    eval_max_new_tokens: int = 128
    # output
    log_every: int = 1
    progress: bool = True
    plot: bool = True
    push_to_hub: str | None = None
    quiet: bool = False

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("samples"), d.pop("eval_prompts")
        return d
