"""python -m dflash.bench ar-draft: an autoregressive draft model cut from a target, for the peers DFlash races
(transformers' assisted generation and mlx-lm's speculative decoding: the `assisted` and `mlx_lm_speculative`
methods, `--ar-draft DIR`): the target's first N decoder layers under its own embeddings, final norm and LM head,
distilled on the target's own greedy answers (chat JSONL, `python -m dflash.data regenerate` format) to its top-k
next-token distributions (the method: backends/torch/ar_draft.py). Held-out agreement and tau before and after
training go to DIR/ar_draft.json.

    python -m dflash.bench ar-draft --model smollm2 --answers answers.jsonl --layers 4 --out ar_draft_smollm2
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from .. import cli
from .. import hub
from ..core.errors import DFlashError
from ..core.io import check_output_dir
from ..core.model_files.tokenizer import load_tokenizer
from ..core.training.ar_draft_config import ARDraftConfig


def parse_args(argv=None):
    d = ARDraftConfig()
    p = cli.Parser(prog="python -m dflash.bench ar-draft", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target: a transformers directory, a prepared name "
                   "(smollm2) or a hub id")
    p.add_argument("--answers", action="append", required=True, help="the target's greedy answers, chat JSONL "
                   "(python -m dflash.data regenerate format); repeatable")
    p.add_argument("--out", required=True, help="the draft's directory (replaced if it exists)")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers kept from the bottom "
                   "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps; 0 = the cut model, untrained "
                   "(default: %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per step "
                   "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="target tokens per position in the distillation "
                   "target (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warmup steps (default: %(default)s)")
    p.add_argument("--heldout", type=int, default=d.heldout, help="answers kept out of training to measure "
                   "agreement and tau on (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per conversation at most")
    p.add_argument("--max-minutes", type=float, help="stop training early past this wall time")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default=d.compute_dtype, help="the training "
                   "steps' matmuls (autocast; weights stay float32, evaluation runs in float32; default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = ARDraftConfig(**{f.name: getattr(args, f.name) for f in fields(ARDraftConfig)})  # checks them
    from ..backends.torch.ar_draft import build, load_answers  # torch, once the flags are checked

    target = hub.resolve(args.model)
    if not (target / "config.json").is_file():
        raise DFlashError(f"--model: {target} has no config.json; expected a transformers model directory")
    out = Path(args.out)
    check_output_dir(out)
    tokenizer = load_tokenizer(target)
    samples = load_answers(args.answers, tokenizer, settings.max_length)
    build(target, tokenizer, samples, out, settings, answers=args.answers, progress=not args.no_progress)
    print(f"ar-draft: wrote {out} (python -m dflash.bench --model {args.model} --ar-draft {out} "
          "--methods assisted,mlx_lm_speculative)", flush=True)
    return 0
