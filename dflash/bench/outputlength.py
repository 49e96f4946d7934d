"""python -m dflash.bench output-length: decoding speed against the length of the output, plain and DFlash side by side.

    python -m dflash.bench output-length                                     # bundled pair: 200 500 1000 2000 tokens
    python -m dflash.bench output-length --model smollm2 --lengths 128 512 1024 --chat --prompt "Tell a long story"

Per-token cost should not grow with the output beyond what attention over a longer context costs: a step that
copies or re-reads the whole output (a cache grown by concatenation, text decoded or searched from the start) shows
here as tokens/s falling with the length. Each --methods entry (plain: --no-draft; chain / tree / auto: --verify)
is loaded once; every length is then decoded greedily by every method in turn, --repeats times, interleaved (load
drift on the machine hits every method alike). EOS is ignored so that every run reaches its length; lengths are
capped to the target's context. Tokens/s = decode tokens / decode seconds (the prefill's token and time excluded),
the median over repeats; `vs first` is that over the first length's. Outputs in --out: results.json, results.md,
tokens_per_second.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import cli
from ..core.errors import DFlashError
from ..core.loop import Generation
from ..core.extras.plots import pyplot, save
from .report import write_report

LENGTHS = (200, 500, 1000, 2000)
METHODS: dict[str, dict[str, Any]]
METHODS = {"plain": {"no_draft": True}, "chain": {"verify": "chain"}, "tree": {"verify": "tree"},
           "auto": {"verify": "auto"}}


def decode(pipe, ids: list[int], n: int):
    """One greedy generation of exactly n tokens (EOS ignored) from a cold cache."""
    pipe.engine.reset()  # no prefix reuse between runs
    return Generation(pipe.engine, ids, tokenizer=pipe.tokenizer, max_new_tokens=n).run()


def markdown(report: dict) -> str:
    methods, rows = report["methods"], report["rows"]
    lines = [f"{report['model']}, prompt of {report['prompt_tokens']} tokens, greedy, EOS ignored, median of "
             f"{report['repeats']}; decode tokens/s (vs the first length).", "",
             "| output tokens | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for n in report["lengths"]:
        cells = []
        for m in methods:
            row = rows.get(f"{m}:{n}")
            cells.append("—" if row is None else f"{row['tokens_per_second']:.1f} ({row['vs_first']:.2f}x)"
                         + (f", tau {row['tau']:.2f}" if m != "plain" else ""))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = pyplot("output-length plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, style in zip(report["methods"], ("o-", "s--", "^:", "D-.")):
        points = [(n, report["rows"][f"{m}:{n}"]["tokens_per_second"]) for n in report["lengths"]
                  if f"{m}:{n}" in report["rows"]]
        if points:
            ax.plot(*zip(*points), style, label=m, markerfacecolor="none")
    ax.set_xlabel("output tokens")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report['model']}: speed against output length", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def write(report: dict, out: Path) -> None:
    write_report(out, report, markdown(report), plot, "tokens_per_second.png", "output-length")


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench output-length", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve")
    cli.add_model_args(p)
    p.add_argument("--methods", default="plain,chain,auto",
                   help=f"comma-separated, of {', '.join(METHODS)} (default: %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="output lengths in tokens "
                   "(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per method and length (default: %(default)s)")
    p.add_argument("--prompt", default="def f(x):", help="the prompt (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="send the prompt through the chat template")
    p.add_argument("--out", default="runs/output_length", help="directory: results.json, results.md, "
                   "tokens_per_second.png")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise DFlashError(f"--methods: got {args.methods!r}, expected a comma-separated list of {', '.join(METHODS)}")
    if min(args.lengths) < 1 or args.repeats < 1:
        raise DFlashError("output-length: --lengths and --repeats take values >= 1")

    pipes = {m: cli.load_pipeline(argparse.Namespace(**{**vars(args), "no_draft": False, **METHODS[m]}))
             for m in methods}
    first = next(iter(pipes.values()))
    ids = first.encode(args.prompt, chat=args.chat)
    max_context = first.engine.max_context
    lengths = sorted({min(n, max_context - len(ids)) if max_context else n for n in args.lengths})
    for pipe in pipes.values():
        decode(pipe, ids, 16)  # warm-up: first-forward allocations and kernel choices are not the length's cost
    runs: dict[str, list] = {f"{m}:{n}": [] for m in methods for n in lengths}
    with tqdm(total=len(runs) * args.repeats, desc="output-length", disable=None) as bar:
        for _ in range(args.repeats):
            for n in lengths:
                for m, pipe in pipes.items():
                    runs[f"{m}:{n}"].append(decode(pipe, ids, n))
                    bar.update()
    rows = {}
    for m in methods:
        base = None
        for n in lengths:
            results = runs[f"{m}:{n}"]
            speed = statistics.median(r.decode_tokens_per_second for r in results)
            base = base or speed
            rows[f"{m}:{n}"] = {"tokens_per_second": speed, "vs_first": speed / base,
                                "runs": [r.decode_tokens_per_second for r in results],
                                "tau": statistics.median(r.mean_acceptance_length for r in results),
                                "new_tokens": results[0].generation_tokens}
    report = {"model": args.model or "the bundled reference pair", "backend": first.backend_name,
              "prompt_tokens": len(ids), "repeats": args.repeats, "methods": methods, "lengths": lengths,
              "rows": rows}
    write(report, Path(args.out))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
