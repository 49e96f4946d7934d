"""Held-out acceptance against answer tokens trained on, for one or more training runs (their train_log.jsonl
evaluations): a table in markdown and a plot of tau and position-1 acceptance.

    python -m dflash.bench learning-curve --run "cross-entropy=runs/ce" --run "KL, top 16=runs/kl" \
        --out runs/learning_curve.png

A drafter trained on in later runs (`--init-from` the first run's drafter, on rows it has not seen) is one curve:
`--run "LABEL=runs/a,runs/b"` counts each later run's steps and answer tokens on from where the run before it
ended.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import cli
from ..core.extras.plots import pyplot, save


def logged(run: Path) -> list[dict]:
    """Every row of the run's train_log.jsonl (training steps and evaluations)."""
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]


def evaluated(rows: list[dict]) -> list[dict]:
    """The evaluation rows, oldest first (the newest row of a step wins: a resumed run may repeat one)."""
    return sorted({r["step"]: r for r in rows if "tau" in r}.values(), key=lambda r: r["step"])


def evaluations(run: Path) -> list[dict]:
    return evaluated(logged(run))


def continued(runs: list[Path]) -> list[dict]:
    """The evaluations of a drafter trained in these runs one after another, its steps and answer tokens counted
    from the first run's start."""
    rows, steps, tokens = [], 0, 0
    for run in runs:
        log = logged(run)
        rows += [dict(r, step=r["step"] + steps, answer_tokens=r.get("answer_tokens", 0) + tokens)
                 for r in evaluated(log)]
        steps += max((r["step"] for r in log), default=0)
        tokens += max((r.get("answer_tokens", 0) for r in log), default=0)
    return rows


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| run | step | answer tokens trained on | tau | acceptance at positions 1 / 2 / 3 | cycles |",
             "|---|---|---|---|---|---|"]
    for label, rows in runs.items():
        for r in rows:
            p = r["per_position"]
            lines.append(f"| {label} | {r['step']} | {r.get('answer_tokens', 0):,} | {r['tau']:.3f} | "
                         f"{' / '.join(f'{x:.3f}' for x in p[:3])} | {r['cycles']} |")
    return "\n".join(lines)


def projection(rows: list[dict], key, goal: float) -> float | None:
    """Answer tokens at which a least-squares line of `key` against log(answer tokens) reaches `goal` (None: the
    line does not rise). A projection from a few points of one run: an order of magnitude, not a promise."""
    import math

    pts = [(math.log(r["answer_tokens"]), key(r)) for r in rows if r.get("answer_tokens")]
    if len(pts) < 2:
        return None
    mx, my = (sum(v) / len(pts) for v in zip(*pts))
    slope = sum((x - mx) * (y - my) for x, y in pts) / max(sum((x - mx) ** 2 for x, _ in pts), 1e-12)
    return math.exp(mx + (goal - my) / slope) if slope > 0 else None


def plot(runs: dict[str, list[dict]], png: Path) -> None:
    plt = pyplot("--out")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, rows in runs.items():
        x = [r.get("answer_tokens", 0) / 1000 for r in rows]
        axes[0].plot(x, [r["tau"] for r in rows], marker="o", label=label)
        axes[1].plot(x, [r["per_position"][0] for r in rows], marker="o", label=label)
    axes[0].set(xlabel="answer tokens trained on (thousands)", ylabel="tau (tokens per cycle)",
                title="held-out acceptance length")
    axes[1].set(xlabel="answer tokens trained on (thousands)", ylabel="acceptance at position 1",
                title="held-out position-1 acceptance")
    for ax in axes:
        ax.set_xscale("log")  # (a curve over several doublings of data: each doubling one step along the axis)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    save(fig, png, dpi=100)


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench learning-curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR[,DIR..]",
                   help="a training run directory (several, comma-separated: one drafter trained on in each in turn)")
    p.add_argument("--out", type=Path, help="the plot (PNG)")
    p.add_argument("--tau", type=float, default=2.0, help="project the answer tokens this tau needs")
    p.add_argument("--p1", type=float, default=0.5, help="... and this position-1 acceptance")
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        label, _, directory = item.rpartition("=")
        runs[label or directory] = continued([Path(d) for d in directory.split(",")])
    print(table(runs))
    for label, rows in runs.items():
        for name, key, goal in (("tau", lambda r: r["tau"], args.tau), ("position-1 acceptance",
                                                                        lambda r: r["per_position"][0], args.p1)):
            at = projection(rows, key, goal)
            print(f"{label}: {name} {goal} projected at "
                  f"{'(not rising)' if at is None else f'{at:.2g} answer tokens'} (log-linear fit)")
    if args.out:
        plot(runs, args.out)
    return 0
