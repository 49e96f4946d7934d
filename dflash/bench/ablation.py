"""One drafter-recipe ablation on the bundled reference pair: train with TrainConfig overrides on the target's
answers, then measure greedy acceptance with the real speculative loop on held-out benchmark prompts.

    python -m dflash.reference build --out runs/data --target dflash/reference/assets/target --answers-only
    OMP_NUM_THREADS=1 python -m dflash.bench ablation --name kl1 --set kl_weight=1.0 [--set KEY=VALUE ...]

Base recipe: BuildConfig().drafter (3 layers, block 16, 64 anchors, batch 4, lr 2e-3, bf16 autocast) and TrainConfig's
defaults for everything else, at --steps steps (no evaluation during training), --seed 0.

Appends one JSON row (name, overrides, steps, train seconds, tau, per-position acceptance) to --log; tau is
measured with the real speculative loop (greedy, plain completion) on the first --prompts held-out benchmark
prompts. --eval-block 8 measures a drafter trained at block 16 with block 8 (and the reverse); --from-run NAME
measures an earlier run's drafter again without training. docs/training.md, section 5, has the table these rows make.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .. import cli
from ..core.errors import DFlashError


def parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench ablation", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--data", default="runs/data", help="a build directory with answers_*.jsonl (--answers-only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TrainConfig override (JSON value)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0, help="seed of the data order, anchors and initialisation")
    p.add_argument("--data-fraction", type=float, default=1.0,
                   help="train on this fraction of the samples (a seeded subset): the data-size ablation")
    p.add_argument("--prompts", type=int, default=16, help="held-out benchmark prompts measured")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--eval-block", type=int, help="measure with this block size (default: the trained one)")
    p.add_argument("--from-run", metavar="NAME", help="measure the drafter of an earlier ablation instead of training")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log", default="runs/ablations.jsonl")
    args = p.parse_args(argv)
    data = Path(args.data)
    target_dir = data / "assets" / "target"
    if not target_dir.is_dir():
        raise DFlashError(f"--data: {data} holds no reference build's answers; make them with `python -m "
                          f"dflash.reference build --out {data} --target dflash/reference/assets/target --answers-only`")
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}

    import torch

    torch.set_num_threads(args.threads)

    from dflash.backends.torch.drafter import load_drafter
    from dflash.backends.torch.target import load_target
    from dflash.backends.torch.training import TrainConfig, train
    from dflash.backends.torch.training.evaluate import evaluate
    from dflash.core.model_files.tokenizer import eos_token_ids, load_tokenizer
    from dflash.reference.build import BuildConfig, build_samples

    samples = build_samples(data)
    if args.data_fraction < 1.0:
        keep = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))[
            :int(len(samples) * args.data_fraction)]
        samples = [samples[i] for i in sorted(keep.tolist())]
    recipe = dict(BuildConfig().drafter, max_steps=args.steps, eval_every=0, eval_holdout=0, log_every=10)
    recipe.update(overrides)
    out = Path("runs/ablations") / args.name
    cfg = TrainConfig(target=str(target_dir), samples=samples, out=str(out), seed=args.seed, device="cpu", save_every=0,
                      plot=False, progress=False, resume=False, quiet=True, **recipe)
    if args.from_run:
        out = Path("runs/ablations") / args.from_run
        seconds = json.loads((out / "ablation.json").read_text())["train_seconds"]
    else:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        train(cfg)
        seconds = time.perf_counter() - t
        (out / "ablation.json").write_text(json.dumps({"train_seconds": round(seconds, 1)}) + "\n")
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]

    tok = load_tokenizer(target_dir)
    prompts = [json.loads(x)["prompt"] for x in (data / "prompts.jsonl").read_text().splitlines()][:args.prompts]
    ids = [tok(x, add_special_tokens=True)["input_ids"] for x in prompts]
    target = load_target(target_dir, torch.float32, "cpu")
    drafter = load_drafter(out / "draft", dtype=torch.float32)
    if args.eval_block:
        drafter.spec.block_size = args.eval_block
    t = time.perf_counter()
    r = evaluate(target, drafter, ids, args.new_tokens, eos_token_ids(target_dir, tok), recipe.get("draft_window"))
    row = {"name": args.name, "overrides": overrides, "seed": args.seed, "data_fraction": args.data_fraction,
           "samples": len(samples), "steps": rows[-1]["step"], "train_seconds": round(seconds, 1),
           "final_loss": round(sum(x["loss"] for x in rows[-3:]) / len(rows[-3:]), 4),
           "eval_seconds": round(time.perf_counter() - t, 1), "eval_block": args.eval_block,
           "tau": round(r["tau"], 3), "first_position": round(r["per_position"][0], 3),
           "per_position": [round(x, 3) for x in r["per_position"][:8]], "cycles": r["cycles"]}
    print(json.dumps(row), flush=True)
    with open(args.log, "a") as f:
        f.write(json.dumps(row) + "\n")
    return 0
