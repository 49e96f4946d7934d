"""A tiny target and a drafter trained for it, built in well under a minute on CPU (tests, the cross-backend check).

The target is a random Qwen3 (dflash.reference.tiny) whose embedding and LM head are scaled up (std 1.0 instead of 0.02): its
logits are sharp, so greedy decoding follows a nearly deterministic token -> token map with some dependence on
context, falling into recurring cycles, which is structure a drafter can learn in seconds. (A plain std-0.02 random
model has near-flat logits: its greedy choices hinge on tiny margins, and the drafter's bounded logit scale
cannot match them quickly.) The drafter is trained with the real trainer on the target's own greedy continuations
of random prompts and reaches a mean acceptance length of about 4-5 at block 16 on held-out prompts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PROMPT_LEN, ANSWER_LEN = 8, 48


def build_tiny_target(directory: str | os.PathLike, seed: int = 0, embed_std: float = 1.0):
    import torch

    from dflash.reference import tiny

    directory = Path(directory)
    tok_dir = directory.parent / (directory.name + "-tokenizer")
    tiny.train_tokenizer(tiny.stdlib_sources(limit_bytes=300_000, seed=seed), 512, tok_dir)
    model = tiny.build_target(directory, tok_dir, seed=seed, init_std=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(embed_std / 0.02)
        model.model.embed_tokens.weight.mul_(embed_std / 0.02)
    model.save_pretrained(str(directory))
    return model.eval()


def greedy_samples(model, n: int, seed: int, prompt_len: int = PROMPT_LEN, answer_len: int = ANSWER_LEN):
    """n random prompts (ordinary tokens only) and the target's greedy continuations, as training samples."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 500, (n, prompt_len), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=answer_len,
                             min_new_tokens=answer_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [{"input_ids": r.tolist(), "loss_mask": [False] * prompt_len + [True] * answer_len} for r in out]


def build_trained_pair(root: str | os.PathLike, *, steps: int = 200, num_train: int = 128, num_eval: int = 8,
                       seed: int = 0, quiet: bool = True) -> tuple[Path, Path, dict]:
    """-> (target_dir, draft_dir, info). info has the held-out tau and the timings; it is also saved as
    root/pair.json, and an existing complete pair under root is reused."""
    from dflash.backends.torch.training import TrainConfig, train

    root = Path(root)
    target_dir, run_dir = root / "target", root / "run"
    info_path = root / "pair.json"
    if info_path.is_file():
        return target_dir, run_dir / "draft", json.loads(info_path.read_text())
    t0 = time.perf_counter()
    model = build_tiny_target(target_dir, seed=seed)
    samples = greedy_samples(model, num_train + num_eval, seed=seed + 1)
    t1 = time.perf_counter()
    train_samples, held = samples[:num_train], samples[num_train:]
    cfg = TrainConfig(target=str(target_dir), samples=train_samples, eval_prompts=[s["input_ids"][:PROMPT_LEN]
                                                                                  for s in held],
                      out=str(run_dir), num_layers=2, block_size=16, num_anchors=48, max_steps=steps, batch_size=4,
                      lr=1e-2, save_every=0, eval_max_new_tokens=64, progress=False, plot=False, quiet=quiet,
                      seed=seed, device="cpu", init_layers="target")  # the recipe this fixture's tau is known at
    result = train(cfg)
    info = {"tau": result.tau, "per_position": result.evals[-1]["per_position"], "steps": result.steps,
            "final_loss": result.losses[-1], "build_seconds": t1 - t0, "train_seconds": result.seconds,
            "eval_prompts": cfg.eval_prompts}
    info_path.write_text(json.dumps(info) + "\n")
    return target_dir, result.draft_dir, info


def dflash2_from(draft, spec2, *, conv_noise: float = 0.0, selector_scale: float = 1.0, seed: int = 0):
    """A DFlash2 drafter (torch module) that starts from a DFlash one: its attention / MLP weights copied, each
    convolution the identity (tap 0 = 1) plus `conv_noise` in the other tap and the kernel projection, and random
    codebooks of scale `selector_scale` (0: the selector is the plain argmax). Noise > 0 makes the drafter
    disagree with its source now and then, which gives cycles with partial acceptance next to long ones."""
    import torch

    from dflash.backends.torch.drafter import DFlashDrafter

    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(spec2)
    state = model.state_dict()
    for name, value in draft.state_dict().items():
        state[name] = value.clone()
    for name, value in state.items():
        if name.endswith("base_kernel"):
            value.normal_(0.0, conv_noise, generator=g) if conv_noise else value.zero_()
            value[:, 0] += 1.0
        elif "kernel_projection" in name:
            value.normal_(0.0, conv_noise, generator=g) if conv_noise else value.zero_()
        elif name.startswith("candidate_selector."):
            value.normal_(0.0, selector_scale, generator=g) if selector_scale else value.zero_()
    model.load_state_dict(state, strict=True)
    return model.eval()
