"""Acceptance of one drafter restricted to draft vocabularies of several sizes (docs/smollm2_drafter.md):

    OMP_NUM_THREADS=1 python scripts/draft_vocab_acceptance.py --model smollm2 --draft smollm2-dflash \\
        --answers ANSWERS.jsonl --sizes 4096,8192,16384,32768 --num-prompts 16 --max-new-tokens 96

Each vocabulary ranks the supervised tokens of ANSWERS (the target's own answers) as `python -m dflash.data
draft-vocab` does. Every held-out prompt (the benchmark split, through the chat template) runs greedy, chain at the
drafter's block size, under every size in turn; greedy output is the target's whatever the vocabulary, so the sizes
see the same tokens and differ only in what the drafter proposes (the script checks that the tokens agree). Then the
draft forward alone (one block over the same context) is timed under every size, interleaved round by round: a
relative figure, meaningful only beside the others of the same run. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash import hub
from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.draft_runner import TorchDraft
from dflash.backends.torch.drafter import load_drafter, with_draft_vocab
from dflash.backends.torch.target import load_target
from dflash.core.contract import Pending
from dflash.core.training.datasets import load_eval_prompts, load_samples
from dflash.core.draft_vocab import count_answer_tokens, select_tokens
from dflash.core.loop import generate
from dflash.core.model_files.tokenizer import load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--answers", required=True, help="the target's answers (ranks the vocabulary)")
    p.add_argument("--prompts", default="dflash/bench/prompts/chat.jsonl", help="held-out prompts")
    p.add_argument("--sizes", default="4096,8192,16384,32768", help="draft vocabulary sizes (the full one is added)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--timing-rounds", type=int, default=30)
    args = p.parse_args()

    model_dir, draft_dir = hub.resolve(args.model, "--model"), hub.resolve(args.draft, "--draft")
    tokenizer = load_tokenizer(model_dir)
    model = load_target(model_dir, torch.float32, "cpu")
    drafter = load_drafter(draft_dir)
    vocab_size = drafter.spec.vocab_size
    counts = count_answer_tokens(load_samples(args.answers, tokenizer))
    total = sum(counts.values())
    head = model.get_output_embeddings().weight
    sizes = [int(s) for s in args.sizes.split(",")]
    drafters = {"full": drafter}
    coverage = {"full": 1.0}
    for size in sizes:
        ids = select_tokens(counts, size, vocab_size)
        drafters[size] = with_draft_vocab(drafter, ids, head).eval()
        coverage[size] = sum(counts[t] for t in ids) / total
    engines = {k: torch_engine(model, d) for k, d in drafters.items()}
    prompts = load_eval_prompts(args.prompts, tokenizer)[:args.num_prompts]

    lengths = {k: [] for k in engines}
    for prompt in prompts:
        tokens = None
        for key, engine in engines.items():
            out = generate(engine, prompt, max_new_tokens=args.max_new_tokens)
            if tokens is not None and out.tokens != tokens:
                raise SystemExit(f"greedy output differs under draft vocabulary {key}")
            tokens = out.tokens
            lengths[key] += out.acceptance_lengths

    # the draft forward alone: one block after the same 128 context positions, every size in turn per round
    features = torch.randn(1, 128, drafter.spec.hidden_size * drafter.spec.num_context_layers)
    anchor = torch.tensor([[prompts[0][-1]]])
    runners = {k: TorchDraft(d, model.get_input_embeddings(), model.get_output_embeddings())
               for k, d in drafters.items()}
    for runner in runners.values():
        runner.extend(Pending(features, [128]))
    seconds = {k: [] for k in runners}
    for _ in range(args.timing_rounds):
        for key, runner in runners.items():
            start = time.perf_counter()
            runner.propose(anchor, None, drafter.spec.block_size)
            seconds[key].append(time.perf_counter() - start)
            runner.crop(128)
    base = statistics.median(seconds["full"])

    rows = []
    for key, acc in lengths.items():
        rows.append({"draft_vocab": key, "answer_token_coverage": round(coverage[key], 4), "cycles": len(acc),
                     "tau": round(sum(acc) / len(acc), 4),
                     "position_1_acceptance": round(sum(a >= 2 for a in acc) / len(acc), 4),
                     "draft_forward_relative_to_full": round(statistics.median(seconds[key]) / base, 3)})
    print(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "answer_tokens": total,
                      "distinct_answer_tokens": len(counts), "vocab_size": vocab_size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
