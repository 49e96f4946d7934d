"""What a training run takes (TrainConfig, framework-neutral: dflash/core/training/train_config.py) and what it returns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.core.training.train_config import TrainConfig

__all__ = ["TrainConfig", "TrainResult"]


@dataclass
class TrainResult:
    draft_dir: Path
    steps: int
    losses: list[float]
    evals: list[dict]
    seconds: float

    @property
    def tau(self) -> float | None:
        return self.evals[-1]["tau"] if self.evals else None
