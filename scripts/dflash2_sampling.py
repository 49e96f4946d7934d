"""Which verification rule accepts more when sampling with a DFlash2 drafter: sample-and-match against the greedy
selector walk, or exact rejection sampling against the selector's distribution q_t (dflash.core.sampling).

Tiny pair: the trained tiny target / drafter of tests/tiny_pair.py, the drafter turned into a DFlash2 one
(identity convolutions + noise 0.02, random rank-16 codebooks of scale 0.3, or scale 0: the selector reduced to the
draft logits). 32 held-out prompts x 64 tokens per setting, seeds 0..31, block 16, PyTorch on the CPU. Then the
16-token pair of tests/test_dflash2.py (a random target and a random DFlash2 drafter whose 16 candidates span the
vocabulary, block 4): 400 generations of 32 tokens per setting.

    OMP_NUM_THREADS=1 python scripts/dflash2_sampling.py --out runs/dflash2_sampling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from dflash import backends
from dflash.backends.torch.drafter import load_drafter, save_drafter
from dflash.core.loop import generate
from dflash.core.sampling import SamplingParams
from dflash.reference import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_pair import build_trained_pair, dflash2_from  # noqa: E402  (the tests' trained tiny pair)


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
    rows += small_vocab_rows(root)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


def small_vocab_rows(root: Path) -> list[dict]:
    from dflash.backends.torch.backend import torch_engine
    from dflash.backends.torch.drafter import DFlashDrafter

    vocab = 16
    model = tiny.build_target(root / "v16", vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, seed=5,
                              init_std=0.3).eval()
    torch.manual_seed(4)
    spec = tiny.draft_spec_for(root / "v16", num_layers=1, block_size=4, mask_token_id=vocab - 1)
    drafter = dflash2_from(DFlashDrafter(spec), tiny.dflash2_spec(spec, selector_rank=8), conv_noise=0.3,
                           selector_scale=0.5, seed=4)
    engine = torch_engine(model, drafter, block_size=4)
    rows = []
    for temperature in (0.8, 1.0):
        for rule in ("match", "rejection"):
            lengths = []
            for seed in range(400):
                params = SamplingParams(temperature=temperature, seed=seed, accept=rule)
                lengths += generate(engine, [3, 1, 4, 1, 5], max_new_tokens=32, sampling=params).acceptance_lengths
            row = {"pair": "16-token", "temperature": temperature, "rule": rule, "tau": sum(lengths) / len(lengths),
                   "cycles": len(lengths)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
