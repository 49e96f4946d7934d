"""Per-position acceptance of every sampling rule on the bundled pair (docs/sampling.md): acceptance, not timing, so
any machine may run it.

For each temperature and rule, the bundled held-out reference prompts are sampled (prompt i with seed + i) by a fixed
chain of block 16 (verify chain: every cycle verifies 15 proposals) or a fixed tree of 15 nodes (verify tree), and
each cycle's accepted length is counted. Acceptance at position k = cycles that accepted >= k draft tokens over
cycles that accepted >= k - 1 (and verified >= k): the probability that the k-th proposal is kept given the ones
before it were.

    OMP_NUM_THREADS=1 python -m dflash.bench acceptance --backend torch --out runs/acceptance_torch.json
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import api, cli
from ..core.loop import generate
from ..core.model_files.tokenizer import load_tokenizer
from ..core.sampling import SamplingParams
from ..reference import reference_dirs
from .prompts import load_prompts

# (label, verify mode, accept rule, draft temperature)
RULES = (("q (rejection)", "chain", "rejection", 1.0), ("sharpened t=0.5", "chain", "sharpened", 0.5),
         ("argmax (one-hot)", "chain", "argmax", 1.0), ("shaped (per request)", "chain", "shaped", 1.0),
         ("coupled match", "chain", "match", 1.0), ("tree: coupled match", "tree", "match", 1.0),
         ("tree: multi (one-hot)", "tree", "multi", 1.0))
POSITIONS = 4


def conditional_acceptance(accepted: list[int], verified: list[int], positions: int) -> list[float]:
    rates = []
    for k in range(1, positions + 1):
        reached = sum(1 for a, v in zip(accepted, verified) if a >= k - 1 and v >= k)
        rates.append(sum(1 for a in accepted if a >= k) / reached if reached else float("nan"))
    return rates


def main(argv=None) -> int:
    ap = cli.Parser(prog="python -m dflash.bench acceptance", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rules", help="comma-separated accept rules to run (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    ap.add_argument("--out", help="JSON rows (also printed, one per line)")
    ap.add_argument("--draft", help="drafter directory (default: the bundled one)")
    args = ap.parse_args(argv)
    target, draft = reference_dirs()
    draft = args.draft or draft
    prompts, _ = load_prompts(["reference"], load_tokenizer(target), args.num_prompts, False, None,
                              args.max_new_tokens)
    wanted = set(args.rules.split(",")) if args.rules else None
    pipes = {mode: api.load(target, draft, backend=args.backend, dtype="float32", device="cpu", verify=mode,
                            tree_budget=15 if mode == "tree" else None) for mode in ("chain", "tree")}
    rows = []
    for temperature in args.temperatures:
        for label, mode, rule, draft_temperature in RULES:
            if wanted and rule not in wanted:
                continue
            accepted, verified, tokens = [], [], 0
            for seed, prompt in enumerate(prompts):
                pipes[mode].engine.reset()
                params = SamplingParams(temperature=temperature, seed=args.seed + seed, accept=rule,
                                        draft_temperature=draft_temperature if rule == "sharpened" else 0.5)
                r = generate(pipes[mode].engine, prompt["ids"], max_new_tokens=args.max_new_tokens, sampling=params)
                accepted += [n - 1 for n in r.acceptance_lengths]
                verified += r.verified
                tokens += len(r.tokens)
            row = {"backend": args.backend, "temperature": temperature, "rule": label, "accept": rule,
                   "tau": (sum(accepted) + len(accepted)) / len(accepted), "cycles": len(accepted),
                   "tokens": tokens, "acceptance": conditional_acceptance(accepted, verified, POSITIONS)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for row in rows:
        print(f"| {row['backend']} | {row['temperature']} | {row['rule']} | {row['tau']:.2f} | "
              + " / ".join(f"{a:.2f}" for a in row["acceptance"]) + " |")
    return 0
