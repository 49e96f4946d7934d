"""python -m dflash.bench long-context: acceptance against context length, with and without a draft window.

    python -m dflash.bench long-context --model smollm2 --out runs/smollm2_long_context
    python -m dflash.bench long-context --model smollm2 --lengths 256 1024 --num-prompts 2 --draft-window none 512

Prompts: for each length L in --lengths, --num-prompts chat prompts of at most L tokens through the target's chat
template (the exact count is recorded): a passage of the Python Language Reference that ships with the interpreter
(pydoc_data.topics: prose, grammar rules and short examples; its sections in an order drawn from --seed and the
prompt's index), cut at a word boundary, then a question about it. Prompt i has the same passage start and the same
question at every length, so only the context grows. A length whose prompt + --max-new-tokens exceeds the target's
context is shortened to fit (8192 becomes 8064 on an 8K target at 128 new tokens).

Each prompt is decoded greedily once target-only, then once per --draft-window value (`none` = the whole context)
with chain verification at the drafter's block size (or --block-size); every output is checked against the
target-only one. Acceptance only, no timing. --out DIR gets results.json, results.md and tau_vs_context.png,
rewritten after every (window, length) cell.
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import sys
from pathlib import Path

from tqdm import tqdm

from .. import cli
from ..core.errors import DFlashError
from ..core.extras.plots import pyplot, save
from ..core.output import mean_acceptance_length, per_position_acceptance
from ..core.model_files.tokenizer import chat_ids
from .report import write_report

LENGTHS = (256, 1024, 2048, 4096, 8192)
WINDOWS = (None, 256, 1024)
UNDERLINE = re.compile(r"^([*=~^-])\1{2,}[ \t]*\n", re.MULTILINE)  # a heading's underline: noise, not prose
QUESTIONS = ("Summarise the passage above in five bullet points.",
             "What does the passage above say about {topic}?",
             "Which rule in the passage above would a beginner most likely get wrong? Explain it with an example.")


# ---- prompts --------------------------------------------------------------------------------------------------------
def reference_sections() -> list[tuple[str, str]]:
    """(title, text) of every section of the Python Language Reference shipped with the interpreter."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DFlashError("long-context: this Python lacks pydoc_data.topics (the Language Reference the passages "
                          "come from); run it with a full CPython install") from None
    sections = []
    for key in sorted(topics):
        text = UNDERLINE.sub("", topics[key]).strip()
        title = text.splitlines()[0].strip() if text else ""
        if title:
            sections.append((title, text))
    return sections


def passage_and_question(sections: list[tuple[str, str]], seed: int, index: int) -> tuple[str, str, str]:
    """(passage, question, first section's title) of prompt `index`: every section, in an order drawn from
    (seed, index); the question asks about the first one, or the passage as a whole."""
    rng = random.Random(f"long-context:{seed}:{index}")
    order = rng.sample(sections, len(sections))
    title = order[0][0]
    topic = title[0].lower() + title[1:] if title[1:2].islower() else title  # "The ..." -> "the ..."
    question = rng.choice(QUESTIONS).format(topic=topic)
    return "\n\n".join(text for _, text in order), question, title


def fit_prompt(tokenizer, passage: str, question: str, length: int) -> list[int]:
    """The chat prompt (passage cut after its k-th word, then the question) with the most words and at most
    `length` tokens."""
    ends = [m.end() for m in re.finditer(r"\S+", passage)]

    def build(k: int) -> list[int]:
        return chat_ids(tokenizer, [{"role": "user", "content": passage[:ends[k - 1]] + "\n\n" + question
                                     if k else question}])

    shortest = len(build(0))
    if shortest > length:
        raise DFlashError(f"--lengths {length}: the chat template and the question alone take {shortest} tokens")
    lo, hi = 0, min(length, len(ends))  # a word is at least one token, so `length` words are enough
    while lo < hi:  # the largest k whose prompt fits (token counts grow with k)
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= length:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def build_prompts(tokenizer, lengths: list[int], num_prompts: int, seed: int) -> list[dict]:
    """[{length, index, ids, question, first_section}] for every length and prompt index."""
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("long-context: the target's tokenizer has no chat template (its prompts are chat turns)")
    sections = reference_sections()
    texts = [passage_and_question(sections, seed, i) for i in range(num_prompts)]
    return [{"length": n, "index": i, "ids": fit_prompt(tokenizer, passage, question, n), "question": question,
             "first_section": title}
            for n in lengths for i, (passage, question, title) in enumerate(texts)]


# ---- decoding -------------------------------------------------------------------------------------------------------
def decode_all(pipe, prompts: list[dict], max_new_tokens: int, progress=None) -> list:
    out = []
    for p in prompts:
        pipe.engine.reset()  # no prefix reuse: prompt i at length L starts like prompt i at shorter lengths
        out.append(pipe.generate(p["ids"], max_new_tokens=max_new_tokens))
        if progress:
            progress()
    return out


def cell(window: int | None, length: int, prompts: list[dict], results: list, block_size: int) -> dict:
    """One (draft window, length) row of the report; `identical` counts outputs equal to the target-only ones."""
    lengths = [n for r in results for n in r.acceptance_lengths]
    same = sum(r.tokens == p["target_only"] for r, p in zip(results, prompts))
    return {"draft_window": window, "length": length, "prompt_tokens": [len(p["ids"]) for p in prompts],
            "new_tokens": [len(r.tokens) for r in results], "tau": mean_acceptance_length(lengths),
            "tau_per_prompt": [r.mean_acceptance_length for r in results],
            "per_position": per_position_acceptance(lengths, block_size), "cycles": len(lengths),
            "identical": same, "lossless": same == len(results)}


def window_label(window: int | None) -> str:
    return "whole context" if window is None else f"window {window}"


# ---- report ---------------------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    windows = report["draft_windows"]
    head = (f"{report['num_prompts']} prompts per length (Language Reference passage + question, chat template), "
            f"{report['max_new_tokens']} new tokens, greedy, chain verification at block {report['block_size']}; "
            "tau per draft window.")
    lines = [head, "", "| length | prompt tokens | " + " | ".join(window_label(w) for w in windows) + " |",
             "|---|---|" + "---|" * len(windows)]
    by_cell = {(r["draft_window"], r["length"]): r for r in report["rows"]}
    for n in report["lengths"]:
        rows = [by_cell.get((w, n)) for w in windows]
        done = [r for r in rows if r is not None]
        if not done:
            continue
        tokens = done[0]["prompt_tokens"]
        taus = [("—" if r is None else f"{r['tau']:.2f}" + ("" if r["lossless"] else " (**not lossless**)"))
                for r in rows]
        lines.append(f"| {n} | {min(tokens)}-{max(tokens)} | " + " | ".join(taus) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = pyplot("long-context plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ("o-", "s--", "^:", "D-.", "v-")  # distinct, so that equal curves (a window past the context) still show
    for w, style in zip(report["draft_windows"], styles * len(report["draft_windows"])):
        rows = [r for r in report["rows"] if r["draft_window"] == w]
        if rows:
            x = [sum(r["prompt_tokens"]) / len(r["prompt_tokens"]) for r in rows]
            ax.plot(x, [r["tau"] for r in rows], style, label=window_label(w), markerfacecolor="none")
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["lengths"], [str(n) for n in report["lengths"]])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens committed per cycle (tau)")
    ax.set_title(f"{report['model']}, block {report['block_size']}, greedy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def write(report: dict, out: Path) -> None:
    write_report(out, report, markdown(report), plot, "tau_vs_context.png", "long-context")


# ---- command line ---------------------------------------------------------------------------------------------------
def window_value(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected none or a number of positions >= 1")
    return value


def load(args, **overrides):
    gc.collect()  # the previous pipeline's weights go before the next one's arrive
    return cli.load_pipeline(argparse.Namespace(**{**vars(args), **overrides}))


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench long-context", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve")
    cli.add_model_args(p)
    p.add_argument("--draft-window", type=window_value, nargs="+", default=list(WINDOWS),
                   help="draft windows to measure, `none` = the whole context (default: none 256 1024)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths in tokens "
                   "(default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per length (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="draws each prompt's passage and question")
    p.add_argument("--out", default="runs/long_context", help="directory: results.json, results.md, "
                   "tau_vs_context.png")
    args = p.parse_args(argv)
    if args.no_draft:
        raise DFlashError("long-context: needs a drafter (drop --no-draft)")
    if min(args.lengths) < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        raise DFlashError("long-context: --lengths, --num-prompts and --max-new-tokens take values >= 1")
    windows = list(dict.fromkeys(args.draft_window))
    args.verify = "chain"

    pipe = load(args, no_draft=True, draft_window=None)
    max_context = pipe.engine.max_context
    lengths = []
    for n in dict.fromkeys(args.lengths):
        fit = min(n, max_context - args.max_new_tokens) if max_context else n
        if fit < n:
            print(f"long-context: length {n} shortened to {fit} tokens: with {args.max_new_tokens} new tokens it "
                  f"fits the target's context of {max_context}", file=sys.stderr)
        lengths.append(fit)
    prompts = build_prompts(pipe.tokenizer, lengths, args.num_prompts, args.seed)
    with tqdm(total=len(prompts) * (1 + len(windows)), desc="long-context", disable=None) as bar:
        for x, r in zip(prompts, decode_all(pipe, prompts, args.max_new_tokens, bar.update)):
            x["target_only"] = r.tokens
        del pipe
        report = {"model": args.model or "the bundled reference target", "draft": None, "block_size": None,
                  "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts, "seed": args.seed,
                  "lengths": lengths, "draft_windows": windows,
                  "prompts": [{k: p[k] for k in ("length", "index", "question", "first_section")}
                              | {"tokens": len(p["ids"])} for p in prompts],
                  "rows": []}
        for w in windows:
            pipe = load(args, draft_window=w)
            if pipe.draft_dir is None:
                raise DFlashError("long-context: no drafter for this target; pass --draft DIR")
            block = pipe.engine.block_size
            report.update(draft=str(pipe.draft_dir), block_size=block)
            for n in lengths:
                group = [x for x in prompts if x["length"] == n]
                results = decode_all(pipe, group, args.max_new_tokens, bar.update)
                report["rows"].append(cell(w, n, group, results, block))
                write(report, Path(args.out))
            del pipe
    print(markdown(report))
    if not all(r["lossless"] for r in report["rows"]):
        print("long-context: some outputs differ from target-only greedy (see 'identical' in results.json)",
              file=sys.stderr)
        return 1
    return 0
