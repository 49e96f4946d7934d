"""python -m dflash.bench tree-curve: committed tokens per cycle against verified tokens per cycle, for chains of
every length and for trees of every budget, on the same prompts (greedy, every output checked against target-only).

Acceptance only, no timing (so any machine may run it): what a budget buys. The cost model turns it into speed on a
device (`python -m dflash.bench cost-model --tree-budgets ... --tree-curve this.json`), and `--verify auto` makes
the same trade every cycle from its own online estimates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from .. import cli
from ..core.errors import DFlashError
from ..core.io import atomic_write_text
from ..core.extras.plots import can_plot, pyplot, save
from ..core.output import mean_acceptance_length
from .prompts import load_prompts

BUDGETS = (1, 2, 4, 8, 15, 24, 32, 48, 64, 96, 128)
CHAINS = (2, 3, 5, 9, 16)  # block sizes: B-1 verified tokens


def run_curve(pipe, prompts: list[list[int]], max_new_tokens: int, budgets, chains, copy_branch: bool,
              progress=None) -> dict:
    backend = pipe.engine
    backend.set_verify("chain")
    reference = [pipe.generate(p, max_new_tokens=max_new_tokens).tokens for p in prompts]
    full_block = backend.block_size
    rows = []

    def measure(label: str, kind: str, verified_target: int):
        lengths, verified, same = [], [], 0
        for p, ref in zip(prompts, reference):
            backend.reset()
            r = pipe.generate(p, max_new_tokens=max_new_tokens)
            same += r.tokens == ref
            lengths += r.acceptance_lengths
            verified += r.verified
            if progress:
                progress()
        rows.append({"label": label, "kind": kind, "budget": verified_target,
                     "tau": mean_acceptance_length(lengths), "verified_per_cycle": sum(verified) / len(verified),
                     "cycles": len(lengths), "lossless": same == len(prompts)})

    for b in chains:
        backend.block_size = b
        backend.set_verify("chain")
        measure(f"chain, block {b}", "chain", b - 1)
    backend.block_size = full_block
    for n in budgets:
        backend.set_verify("tree", n, copy_branch=copy_branch)
        measure(f"tree, {n} nodes", "tree", n)
    backend.set_verify("chain")
    return {"rows": rows, "block_size": full_block, "copy_branch": copy_branch}


def markdown(report: dict) -> str:
    lines = [f"{report['prompts']} prompts ({report['prompt_source']}), {report['max_new_tokens']} new tokens, greedy, "
             f"block {report['block_size']}; trees {'with' if report['copy_branch'] else 'without'} the copied "
             "branch.", "", "| verify | verified tokens / cycle | tau | cycles | lossless |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['label']} | {r['verified_per_cycle']:.1f} | {r['tau']:.2f} | {r['cycles']} | "
                     f"{'yes' if r['lossless'] else '**NO**'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = pyplot("tree-curve plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, style in (("chain", "o-"), ("tree", "s-")):
        pts = [(r["verified_per_cycle"], r["tau"]) for r in report["rows"] if r["kind"] == kind]
        ax.plot(*zip(*pts), style, label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft tokens verified per cycle")
    ax.set_ylabel("tokens committed per cycle (tau)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench tree-curve", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_args(p)
    p.add_argument("--prompts", default="reference", help="reference (the bundled held-out prompts) or humaneval")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--chains", type=int, nargs="+", default=list(CHAINS), help="chain block sizes")
    p.add_argument("--out", default="runs/tree_curve", help="path prefix: .json, .md and .png are written")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.budgets):
        raise DFlashError(f"--budgets: got {args.budgets}, expected values >= 1")
    args.verify = "chain"
    pipe = cli.load_pipeline(args)
    if pipe.draft_dir is None:
        raise DFlashError("tree-curve: needs a drafter (drop --no-draft)")
    rows, _ = load_prompts([args.prompts], pipe.tokenizer, args.num_prompts, False, pipe.engine.max_context,
                           args.max_new_tokens)
    prompts = [x["ids"] for x in rows]
    total = len(prompts) * (len(args.chains) + len(args.budgets))
    with tqdm(total=total, desc="tree-curve", disable=None) as bar:
        report = run_curve(pipe, prompts, args.max_new_tokens, args.budgets, args.chains, args.copy_branch,
                           progress=lambda: bar.update())
    report.update(prompts=len(prompts), prompt_source=args.prompts, max_new_tokens=args.max_new_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(out) + ".json", json.dumps(report, indent=2))
    atomic_write_text(str(out) + ".md", markdown(report))
    if can_plot("tree-curve"):
        plot(report, Path(str(out) + ".png"))
    print(markdown(report))
    return 0

