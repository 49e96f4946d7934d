"""Acceptance against context length: greedy tau of drafters on prompts of N tokens cut from held-out files.

    OMP_NUM_THREADS=1 python scripts/context_curve.py --draft runs/ablations/base/draft \\
        --draft runs/ablations/window64/draft:64 --lengths 256,512,1024,1536 --prompts 4

Each --draft is DIR or DIR:WINDOW (run with --draft-window WINDOW, as it was trained). Prompts: the first N tokens of
the held-out stdlib files with at least N tokens (never trained on), one per file; the target is the bundled one
(max_position_embeddings 2048, pretrained on 512-token windows), so N + --new-tokens stays below 2048. Prints one
JSON line per (drafter, length) and appends it to --log.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="dflash/reference/assets/target")
    p.add_argument("--draft", action="append", required=True, metavar="DIR[:WINDOW]")
    p.add_argument("--lengths", default="256,512,1024,1536")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log", default="runs/context_curve.jsonl")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import dflash
    from dflash.core.stats import mean_acceptance_length, per_position_acceptance
    from dflash.core.model_files.tokenizer import load_tokenizer
    from dflash.reference.corpus import source_files, split

    tok = load_tokenizer(args.target)
    _, heldout = split(source_files())
    encoded = sorted((tok(f.text)["input_ids"] for f in heldout), key=len, reverse=True)
    for spec in args.draft:
        path, _, window = spec.partition(":")
        window = int(window) if window else None
        pipe = dflash.load(args.target, path, backend="torch", device="cpu", draft_window=window)
        for n in (int(x) for x in args.lengths.split(",")):
            prompts = [ids[:n] for ids in encoded if len(ids) >= n][:args.prompts]
            lengths = []
            for ids in prompts:
                lengths += pipe.generate(ids, max_new_tokens=args.new_tokens).acceptance_lengths
            row = {"draft": path, "draft_window": window, "context": n, "prompts": len(prompts),
                   "tau": round(mean_acceptance_length(lengths), 3),
                   "first_position": round(per_position_acceptance(lengths, pipe.backend.block_size)[0], 3),
                   "cycles": len(lengths)}
            print(json.dumps(row), flush=True)
            with open(args.log, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
