"""Which verification rule accepts more when sampling with a DFlash2 drafter: sample-and-match against the greedy
selector walk, or exact rejection sampling against the selector's distribution q_t (dflash.sampling).

Tiny pair: the trained tiny target / drafter of backends/torch/tiny_pair.py, the drafter turned into a DFlash2 one
(identity convolutions + noise 0.02, random rank-16 codebooks of scale 0.3, or scale 0: the selector reduced to the
draft logits). 32 held-out prompts x 64 tokens per setting, seeds 0..31, block 16, PyTorch on the CPU.

    OMP_NUM_THREADS=1 python scripts/dflash2_sampling.py --out runs/dflash2_sampling.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from dflash import backends, tiny
from dflash.backends.torch.drafter import load_drafter, save_drafter
from dflash.backends.torch.tiny_pair import build_trained_pair, dflash2_from
from dflash.loop import generate
from dflash.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="dflash2-sampling-"))
    target_dir, draft_dir, _ = build_trained_pair(root / "pair")
    source = load_drafter(draft_dir)
    prompts = torch.randint(3, 500, (args.prompts, 8), generator=torch.Generator().manual_seed(123)).tolist()
    rows = []
    for selector_scale in (0.3, 0.0):
        d = root / f"dflash2-{selector_scale}"
        save_drafter(dflash2_from(source, tiny.dflash2_spec(source.spec), conv_noise=0.02,
                                  selector_scale=selector_scale), d)
        engine = backends.get("torch").load(target_dir, d, dtype="float32", device="cpu")
        for temperature in (0.8, 1.0):
            for rule in ("match", "rejection"):
                lengths = []
                for seed, p in enumerate(prompts):
                    params = SamplingParams(temperature=temperature, seed=seed, accept=rule)
                    lengths += generate(engine, p, max_new_tokens=args.max_new_tokens, sampling=params
                                        ).acceptance_lengths
                row = {"selector_scale": selector_scale, "temperature": temperature, "rule": rule,
                       "tau": sum(lengths) / len(lengths), "cycles": len(lengths)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
