"""Training throughput on the bundled reference pair: steps/s and tokens/s of `train()` for a fixed batch.

    OMP_NUM_THREADS=1 python scripts/train_speed.py --steps 40 [--set KEY=VALUE ...]

Tokens = every token of the sequences in the global batch (what the target forward and the context projection
process); slots = supervised block positions. Times come from the run's own log (elapsed per step), skipping the
first --warmup steps. Prints one JSON line. Runs against whichever `dflash` is imported, so the same command
measures two versions of the trainer side by side.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/data")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/speed")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from dflash.backends.torch.training import TrainConfig, train
    from dflash.reference.build import BuildConfig, build_samples

    data = Path(args.data)
    target_dir = data / "assets" / "target"
    samples = build_samples(data)
    recipe = dict(BuildConfig().drafter, max_steps=args.steps, eval_every=0, eval_holdout=0, log_every=1)
    recipe.update({k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)})
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = TrainConfig(target=str(target_dir), samples=samples, out=args.out, seed=0, device="cpu", save_every=0,
                      plot=False, progress=False, resume=False, quiet=True, **recipe)
    train(cfg)
    rows = [json.loads(x) for x in (Path(args.out) / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    # the global batch of every step, in the trainer's own order (seeded permutation per epoch)
    gb = cfg.batch_size * cfg.grad_accum
    per_epoch = len(samples) // gb
    tokens = []
    for s in range(args.steps):
        epoch, i = divmod(s, per_epoch)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch)).tolist()
        tokens.append(sum(len(samples[j]["input_ids"]) for j in order[i * gb:(i + 1) * gb]))
    w = args.warmup
    seconds = rows[-1]["elapsed"] - rows[w - 1]["elapsed"]
    steps = len(rows) - w
    print(json.dumps({"steps_timed": steps, "seconds": round(seconds, 2), "s_per_step": round(seconds / steps, 3),
                      "tokens_per_s": round(sum(tokens[w:]) / seconds, 1), "recipe": {k: recipe[k] for k in sorted(
                          recipe) if k in ("num_layers", "num_anchors", "batch_size", "dtype", "kl_weight")}}))


if __name__ == "__main__":
    main()
