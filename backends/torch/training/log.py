"""What a run tells: console lines, a progress bar, and train_log.jsonl (one row per logged step, one per
evaluation, each with the answer tokens trained on so far), on the main rank only. Rows a resumed run starts from are
the ones its checkpoint covers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .distributed import Dist


class RunLog:
    def __init__(self, cfg: TrainConfig, d: Dist, out: Path, rows: list[dict], *, total: int, started: float):
        self.cfg, self.main, self.total, self.started = cfg, d.main, total, started
        self.losses = [r["loss"] for r in rows if "loss" in r]
        self.evals = [r for r in rows if "tau" in r]
        # answer tokens trained on so far (the learning curve's x): a resumed run's from its checkpoint's step,
        # which is always logged
        self.tokens = next((r["answer_tokens"] for r in reversed(rows) if "answer_tokens" in r), 0)
        self.path = out / "train_log.jsonl"
        self.file = open(self.path, "a") if d.main else None
        self.show_bar = d.main and cfg.progress and not cfg.quiet
        self.bar: Any = None  # a tqdm bar, opened at the first step, after the run's opening lines

    def say(self, msg: str) -> None:
        if self.main and not self.cfg.quiet:
            print(msg, flush=True)

    def write(self, row: dict) -> None:
        assert self.file is not None  # (the main process writes)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def step(self, row: dict) -> None:
        """The log row of a finished step (every --log-every steps and the last one), and the bar."""
        if not self.main:
            return
        self.losses.append(row["loss"])
        self.tokens += row["answer_tokens"]
        at = row["step"]
        if at % self.cfg.log_every == 0 or at == self.total or (self.cfg.save_every and at % self.cfg.save_every == 0):
            self.write(dict(row, answer_tokens=self.tokens, elapsed=time.perf_counter() - self.started))
        if self.show_bar:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=row["step"] - 1, desc="train", dynamic_ncols=True)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.2f}", lr=f"{row['lr']:.1e}")

    def evaluation(self, row: dict) -> None:
        row = dict(row, answer_tokens=self.tokens)
        self.evals.append(row)
        self.write(row)
        self.say(f"eval step {row['step']}: tau {row['tau']:.2f} over {row['cycles']} cycles")

    def evaluated_at(self, step: int) -> bool:
        return bool(self.evals) and self.evals[-1]["step"] == step

    def end_of_steps(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.show_bar, self.bar = False, None

    def close(self) -> None:
        self.end_of_steps()
        if self.file is not None:
            self.file.close()
