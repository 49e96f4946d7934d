"""The settings of an autoregressive draft's distillation. No torch import, so the CLI parses (and --help
answers) before any framework loads."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DFlashError


@dataclass(frozen=True)
class ARDraftConfig:
    """One distillation of an autoregressive draft (backends/torch/ar_draft.py): the flags of
    `python -m dflash.bench ar-draft` and their defaults."""
    layers: int = 4  # decoder layers kept from the bottom
    steps: int = 100  # optimizer steps; 0 = the cut model, untrained
    batch_tokens: int = 2048  # padded tokens per step
    top_k: int = 32  # target tokens per position in the distillation target
    lr: float = 1e-3  # peak learning rate
    warmup: int = 10
    heldout: int = 12  # answers kept out of training to measure agreement and tau on
    max_length: int = 1024  # tokens per conversation at most
    max_minutes: float | None = None  # stop training early past this wall time
    compute_dtype: str = "bfloat16"  # the training steps' matmuls (autocast); weights and evaluation stay float32
    threads: int = 1
    seed: int = 0

    def __post_init__(self):
        for flag in ("layers", "batch_tokens", "threads", "top_k"):
            if getattr(self, flag) < 1:
                raise DFlashError(f"--{flag.replace('_', '-')}: got {getattr(self, flag)}, expected >= 1")
        if self.steps < 0 or self.heldout < 0:
            raise DFlashError("--steps and --heldout: expected >= 0")
