"""Evaluation that measures what matters: the real speculative loop (greedy) on held-out prompts, pooled into tau,
per-position acceptance and the acceptance histogram. Token accuracy during training is not tau."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..drafter import DFlashDrafter


@torch.no_grad()
def evaluate(target_model, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
             eos_token_ids=(), draft_window: int | None = None, progress: str | None = None) -> dict:
    """Real acceptance: run the speculative loop (greedy) on each prompt and pool the acceptance lengths.
    `progress`: the description of a tqdm bar over the prompts (None: no bar)."""
    from dflash.loop import generate
    from dflash.stats import acceptance_histogram, mean_acceptance_length, per_position_acceptance

    from ..backend import TorchBackend

    dtype = target_model.get_input_embeddings().weight.dtype
    was_training = drafter.training
    backend = TorchBackend(target_model, drafter.to(dtype).eval(), draft_window=draft_window)
    lengths = []
    if progress:
        from tqdm import tqdm

        prompts = tqdm(prompts, desc=progress, leave=False, dynamic_ncols=True)
    try:
        for p in prompts:
            backend.reset()
            lengths += generate(backend, p, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)\
                .acceptance_lengths
    finally:
        backend.close()
        drafter.train(was_training)
    b = drafter.spec.block_size
    return {"tau": mean_acceptance_length(lengths), "cycles": len(lengths),
            "per_position": per_position_acceptance(lengths, b), "histogram": acceptance_histogram(lengths, b)}


def plot_curves(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "tau" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows])
    axes[0].set(xlabel="step", ylabel="loss", title="training loss")
    axes[1].plot([r["step"] for r in eval_rows], [r["tau"] for r in eval_rows], marker="o")
    axes[1].set(xlabel="step", ylabel="tau", title="acceptance length (speculative loop, greedy)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
