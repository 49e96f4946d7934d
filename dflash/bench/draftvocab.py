"""python -m dflash.bench draft-vocab: the acceptance of one drafter restricted to draft vocabularies of several sizes.

    python -m dflash.bench draft-vocab --model smollm2 --draft smollm2-dflash --answers ANSWERS.jsonl \\
        --sizes 4096 8192 16384 32768 --num-prompts 16 --max-new-tokens 96 --out runs/draft_vocab.json

Each vocabulary ranks the supervised tokens of --answers (the target's own answers, `python -m dflash.data
regenerate`) as `python -m dflash.data draft-vocab` does; the full vocabulary is measured beside them. Every prompt
(--prompts, the bundled chat set by default, through the chat template) runs greedy, chain at the drafter's block
size, under every size in turn: greedy output is the target's whatever the vocabulary, so the sizes see the same
tokens and differ only in what the drafter proposes (a size whose tokens differ is an error). Then the draft
forward alone (one block over the same 128 context positions) is timed under every size, interleaved round by
round: a relative figure, meaningful only beside the others of the same run. PyTorch, float32, on the CPU. Prints one
JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .. import cli
from .. import hub
from ..core.contract import Pending
from ..core.draft_vocab import count_answer_tokens, select_tokens
from ..core.errors import DFlashError
from ..core.io import atomic_write_text
from ..core.loop import generate
from ..core.model_files.tokenizer import load_tokenizer
from ..core.training.datasets import load_samples
from .prompts import load_prompts

SIZES = (4096, 8192, 16384, 32768)
CONTEXT = 128  # positions of target features the timed draft forward reads


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.bench draft-vocab", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target: a transformers directory, a prepared name "
                   "(smollm2) or a hub id")
    p.add_argument("--draft", required=True, help="the DFlash drafter (directory, hub id or registry name), "
                   "with its full vocabulary")
    p.add_argument("--answers", required=True, help="the target's answers, chat JSONL (python -m dflash.data "
                   "regenerate): they rank the vocabulary")
    p.add_argument("--prompts", default="chat", help="held-out prompts: chat, reference, humaneval or a JSONL file "
                   "(default: %(default)s)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="draft vocabulary sizes (default: "
                   "%(default)s)")
    p.add_argument("--num-prompts", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="(default: %(default)s)")
    p.add_argument("--timing-rounds", type=int, default=30, help="rounds of the timed draft forward, every size "
                   "once per round (0: no timing; default: %(default)s)")
    p.add_argument("--out", help="also write the JSON object here")
    args = p.parse_args(argv)
    if min(args.sizes) < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or args.timing_rounds < 0:
        raise DFlashError("draft-vocab: --sizes, --num-prompts and --max-new-tokens take values >= 1, "
                          "--timing-rounds >= 0")
    return args


def acceptance(engines: dict, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Every engine's acceptance lengths over the prompts, each prompt decoded by every engine in turn."""
    lengths: dict = {k: [] for k in engines}
    for n, prompt in enumerate(prompts):
        tokens = None
        for key, engine in engines.items():
            out = generate(engine, prompt, max_new_tokens=max_new_tokens)
            if tokens is not None and out.tokens != tokens:
                raise DFlashError(f"draft-vocab: prompt {n}: greedy output under draft vocabulary {key} differs "
                                  "from the full vocabulary's")
            tokens = out.tokens
            lengths[key] += out.acceptance_lengths
    return lengths


def draft_seconds(engines: dict, anchor: int, rounds: int) -> dict:
    """Median seconds of one draft forward per engine's drafter, over the same random context."""
    import torch

    first = next(iter(engines.values())).drafter
    features = torch.randn(1, CONTEXT, first.spec.hidden_size * first.spec.num_context_layers)
    drafters = {k: e.drafter.spawn() for k, e in engines.items()}  # fresh caches: the engines' stay as they are
    for d in drafters.values():
        d.extend(Pending(features, [CONTEXT]))
    seconds: dict = {k: [] for k in drafters}
    ids = torch.tensor([[anchor]])
    for _ in range(rounds):
        for key, d in drafters.items():
            start = time.perf_counter()
            d.propose(ids, None, d.spec.block_size)
            seconds[key].append(time.perf_counter() - start)
            d.crop(CONTEXT)
    return {k: statistics.median(v) for k, v in seconds.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from ..backends.torch import load_drafter, load_target, torch_engine, with_draft_vocab

    model_dir, draft_dir = hub.resolve(args.model, "--model"), hub.resolve(args.draft, "--draft")
    tokenizer = load_tokenizer(model_dir)
    model = load_target(model_dir, torch.float32, "cpu")
    drafter = load_drafter(draft_dir)
    vocab_size = drafter.spec.vocab_size
    counts = count_answer_tokens(load_samples(args.answers, tokenizer))
    total = sum(counts.values())
    if not total:
        raise DFlashError(f"--answers: {args.answers} holds no answer tokens")
    head = model.get_output_embeddings().weight
    drafters: dict[str | int, Any] = {"full": drafter}
    coverage: dict[str | int, float] = {"full": 1.0}
    for size in args.sizes:
        vocab = select_tokens(counts, size, vocab_size)
        drafters[size] = with_draft_vocab(drafter, vocab, head).eval()
        coverage[size] = sum(counts[t] for t in vocab) / total
    engines = {k: torch_engine(model, d) for k, d in drafters.items()}
    prompts, _ = load_prompts([args.prompts], tokenizer, args.num_prompts, chat=True, max_context=None,
                              max_new_tokens=args.max_new_tokens)
    ids = [p["ids"] for p in prompts]
    lengths = acceptance(engines, ids, args.max_new_tokens)
    seconds = draft_seconds(engines, ids[0][-1], args.timing_rounds) if args.timing_rounds else None
    rows = []
    for key, acc in lengths.items():
        row = {"draft_vocab": key, "answer_token_coverage": round(coverage[key], 4), "cycles": len(acc),
               "tau": round(sum(acc) / len(acc), 4),
               "position_1_acceptance": round(sum(a >= 2 for a in acc) / len(acc), 4)}
        if seconds:
            row["draft_forward_relative_to_full"] = round(seconds[key] / seconds["full"], 3)
        rows.append(row)
    report = json.dumps({"prompts": len(ids), "max_new_tokens": args.max_new_tokens, "answer_tokens": total,
                         "distinct_answer_tokens": len(counts), "vocab_size": vocab_size, "rows": rows}, indent=1)
    print(report)
    if args.out:
        atomic_write_text(Path(args.out), report + "\n")
    return 0
