"""Evaluation that measures what matters: the real speculative loop (greedy) on held-out prompts, pooled into tau,
per-position acceptance and the acceptance histogram. Token accuracy during training is not tau."""

from __future__ import annotations

import torch

from ..drafter import DFlashDrafter
from .checkpoint import full_model_state


@torch.no_grad()
def evaluate(target_model, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
             eos_token_ids=(), draft_window: int | None = None, progress: str | None = None) -> dict:
    """Real acceptance: run the speculative loop (greedy) on each prompt and pool the acceptance lengths.
    `progress`: the description of a tqdm bar over the prompts (None: no bar)."""
    from dflash.core.loop import generate
    from dflash.core.output import acceptance_histogram, mean_acceptance_length, per_position_acceptance

    from ..backend import torch_engine

    dtype = target_model.get_input_embeddings().weight.dtype
    was_training = drafter.training
    backend = torch_engine(target_model, drafter.to(dtype).eval(), draft_window=draft_window)
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


def evaluate_run(run, log, at: int) -> None:
    """Measure the drafter of step `at` on the run's held-out prompts (on the main rank) and log it. Every rank
    calls it: the full weights are a collective under FSDP."""
    if not run.eval_prompts:
        return
    cfg, d = run.cfg, run.d
    state = full_model_state(run.module, run.drafter, run.fsdp)
    if d.main:
        probe = DFlashDrafter(run.drafter.spec)
        probe.load_state_dict(state)
        show = cfg.progress and not cfg.quiet
        if not show:  # a bar says it itself; without one, a line, so a long evaluation does not look like a hang
            log.say(f"eval step {at}: generating on {len(run.eval_prompts)} held-out prompts "
                    f"({cfg.eval_max_new_tokens} tokens each)")
        r = evaluate(run.target, probe.to(run.device), run.eval_prompts, cfg.eval_max_new_tokens, run.eos,
                     cfg.draft_window, progress=f"eval step {at}" if show else None)
        if hasattr(run.features, "capture"):  # the loop's target forwards went through the feature hooks too
            run.features.capture.outputs.clear()
        log.evaluation({"step": at, **r})
    d.barrier()
