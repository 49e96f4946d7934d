"""python -m dflash.data: prepare drafter training data.

  regenerate      answer prompts with the TARGET (the drafter must learn the target's own outputs); resumable:
                    python -m dflash.data regenerate --model T --input prompts.jsonl --output answers.jsonl
                  or through any OpenAI-compatible server (python -m dflash.serve, vLLM, ...):
                    python -m dflash.data regenerate --endpoint http://127.0.0.1:8000 --input ... --output ...
  self-prompts    prompts the target writes itself (Magpie): sample its chat template's user-turn prefix:
                    python -m dflash.data self-prompts --model T --num-prompts 2000 --output prompts.jsonl \
                        --exclude dflash/bench/prompts/chat.jsonl
  answers         self-prompted answers at batch scale: the target writes requests and answers them in lanes
                  refilled as they finish, into numbered token shards (2 bytes a token); resumable:
                    python -m dflash.data answers --model T --out answers/ --answers 25000 \
                        --exclude dflash/bench/prompts/chat.jsonl
  draft-vocab     give a drafter a draft vocabulary of the N tokens most frequent in the target's answers (FR-Spec;
                  EAGLE-3's d2t/t2d, as vLLM reads them):
                    python -m dflash.data draft-vocab --model T --data answers.jsonl --draft D --size 8192 --out D8K
  cache-features  precompute the target's hidden states for offline training (sharded safetensors):
                    python -m dflash.data cache-features --model T --data answers.jsonl --out feats/ --num-layers 5

Inputs: chat JSONL ("messages" or ShareGPT "conversations"), prompt JSONL ("prompt"), or a `datasets` directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import cli, hub
from .core.training.datasets import load_samples
from .core.extras.deps import require
from .core.errors import DFlashError
from .core.io import check_output_dir
from .core.spec import default_target_layer_ids
from .core.model_files.tokenizer import load_tokenizer
from .remote_regeneration import regenerate_remote


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.data", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("regenerate", help="answer prompts with the target (resumable)")
    r.add_argument("--model", help="target: local HF directory or hub id (with --endpoint: the served model "
                   "name, default: the server's first)")
    r.add_argument("--endpoint", help="answer through this OpenAI-compatible server instead of in-process")
    r.add_argument("--concurrency", type=int, default=8, help="with --endpoint: requests in flight "
                   "(default: %(default)s)")
    r.add_argument("--api-key", help="with --endpoint: Bearer key (default: $OPENAI_API_KEY)")
    r.add_argument("--input", required=True, help="prompts / chats: JSONL file or datasets directory")
    r.add_argument("--output", required=True, help="training JSONL to append to (rerun the same command to resume)")
    r.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (batched speculative "
                   "decoding)")
    r.add_argument("--draft", help="a DFlash drafter for the target (directory or hub id): same answers, faster")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s = off)")
    r.add_argument("--max-new-tokens", type=int, default=2048, help="tokens per answer at most (default: "
                   "%(default)s)")
    r.add_argument("--max-prompt-tokens", type=int, help="skip longer prompts (default: context - max-new-tokens)")
    think = r.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=None,
                       help="render prompts with enable_thinking=True (serve the drafter the same way)")
    think.add_argument("--disable-thinking", dest="enable_thinking", action="store_false")
    r.add_argument("--seed", type=int, default=0)
    _common(r)

    m = sub.add_parser("self-prompts", help="prompts the target writes itself (Magpie; resumable)")
    m.add_argument("--model", required=True, help="an aligned chat target: local HF directory or hub id")
    m.add_argument("--output", required=True, help="prompt JSONL to append to (rerun the same command to resume)")
    m.add_argument("--num-prompts", type=int, required=True, help="distinct prompts to end with")
    m.add_argument("--exclude", nargs="*", default=[], help="prompt files none may copy (the benchmark split)")
    m.add_argument("--system", help="a system turn steering the prompts' domain (default: the template's own)")
    m.add_argument("--id-prefix", default="self", help="row ids are PREFIX/N (default: %(default)s)")
    m.add_argument("--batch-size", type=int, default=32)
    m.add_argument("--max-tokens", type=int, default=96, help="a question longer than this is dropped")
    m.add_argument("--temperature", type=float, default=1.0)
    m.add_argument("--top-p", type=float, default=0.95)
    m.add_argument("--seed", type=int, default=0)
    _common(m)

    a = sub.add_parser("answers", help="self-prompted answers into token shards (resumable)")
    a.add_argument("--model", required=True, help="an aligned chat target: local HF directory or hub id")
    a.add_argument("--out", required=True, help="shard directory to add to (rerun the same command to resume)")
    a.add_argument("--answers", type=int, required=True, help="answers the directory should hold in the end")
    a.add_argument("--exclude", nargs="*", default=[], help="prompt files no request may copy (the benchmark split)")
    a.add_argument("--lanes", type=int, default=128, help="conversations decoded together (default: %(default)s)")
    a.add_argument("--max-answer-tokens", type=int, default=320, help="an answer is cut here (default: %(default)s)")
    a.add_argument("--sampled-fraction", type=float, default=0.25,
                   help="answers drawn at --answer-temperature, the rest greedy (default: %(default)s)")
    a.add_argument("--answer-temperature", type=float, default=0.7)
    a.add_argument("--shard-rows", type=int, default=256, help="answers per shard file (default: %(default)s)")
    a.add_argument("--seed", type=int, default=0)
    _common(a)

    v = sub.add_parser("draft-vocab", help="give a drafter a draft vocabulary ranked from the target's answers")
    v.add_argument("--model", required=True, help="target: local HF directory or hub id (its LM head's rows)")
    v.add_argument("--data", required=True, help="the target's answers: training JSONL or datasets directory (the "
                   "assistant tokens are counted)")
    v.add_argument("--draft", required=True, help="the drafter (directory or hub id), without a draft vocabulary")
    v.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary")
    v.add_argument("--out", required=True, help="output directory: the drafter with its draft vocabulary")
    v.add_argument("--max-length", type=int, default=3072)
    think = v.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=None)
    think.add_argument("--disable-thinking", dest="enable_thinking", action="store_false")
    v.add_argument("--trust-remote-code", action="store_true")
    v.add_argument("--debug", action="store_true", help="full tracebacks")

    c = sub.add_parser("cache-features", help="precompute target features for offline training")
    c.add_argument("--model", required=True, help="target: local HF directory or hub id")
    c.add_argument("--data", required=True, help="training JSONL (chat or tokenised rows) or datasets directory")
    c.add_argument("--out", required=True, help="output directory (sharded safetensors + features.index.json)")
    c.add_argument("--num-layers", type=int, default=5, help="draft layers: picks the default target layer ids")
    c.add_argument("--target-layer-ids", help="comma-separated target layer ids (overrides --num-layers)")
    c.add_argument("--max-length", type=int, default=3072)
    c.add_argument("--feature-dtype", default="bfloat16", help="bfloat16, float16 or float32 on disk")
    c.add_argument("--shard-gb", type=float, default=1.0, help="approximate shard size in GiB")
    c.add_argument("--top-k", type=int, default=0,
                   help="also keep the target's K most likely next tokens at every position: the soft label of "
                        "`python -m dflash.train --kl-weight` (6 bytes a token each; default: 0 = none)")
    think = c.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=None)
    think.add_argument("--disable-thinking", dest="enable_thinking", action="store_false")
    _common(c)
    return p.parse_args(argv)


def _common(p):
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda[:N], mps")
    p.add_argument("--dtype", default="auto", help="target dtype: auto, float32, bfloat16, float16")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="full tracebacks")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "regenerate" and args.endpoint:
        return regenerate_through(args)
    if args.command == "regenerate" and not args.model:
        raise DFlashError("--model: required (or --endpoint URL to answer through a server)")
    require("torch", f"python -m dflash.data {args.command}")  # both run the target through transformers on torch
    if args.command == "self-prompts":
        from dflash.backends.torch import write_self_prompts

        stats = write_self_prompts(hub.resolve(args.model, "--model"), args.output, num_prompts=args.num_prompts,
                                   batch_size=args.batch_size, max_tokens=args.max_tokens,
                                   temperature=args.temperature, top_p=args.top_p, exclude=args.exclude,
                                   system=args.system, id_prefix=args.id_prefix, seed=args.seed,
                                   device=args.device, dtype=args.dtype,
                                   trust_remote_code=args.trust_remote_code, progress=not args.no_progress,
                                   log=lambda m: print(m, file=sys.stderr))
        print(json.dumps(stats))
        return 0
    if args.command == "draft-vocab":
        return draft_vocab(args)
    if args.command == "answers":
        return answers(args)
    if args.command == "regenerate":
        from dflash.backends.torch import regenerate

        stats = regenerate(hub.resolve(args.model, "--model"), args.input, args.output,
                           batch_size=args.batch_size,
                           temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                           enable_thinking=args.enable_thinking, max_prompt_tokens=args.max_prompt_tokens,
                           device=args.device, dtype=args.dtype, seed=args.seed,
                           trust_remote_code=args.trust_remote_code, progress=not args.no_progress,
                           draft=hub.resolve(args.draft, "--draft") if args.draft else None,
                           log=lambda m: print(m, file=sys.stderr))
        print(json.dumps(stats))
        return 0 if stats["failed"] == 0 else 1
    return cache_features(args)


def regenerate_through(args) -> int:
    if args.draft:
        raise DFlashError("--draft: the server decides how it decodes; drop --draft with --endpoint")
    stats = regenerate_remote(args.endpoint, args.input, args.output, model=args.model,
                              api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                              concurrency=args.concurrency, temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, enable_thinking=args.enable_thinking,
                              seed=args.seed, progress=not args.no_progress,
                              log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(stats))
    return 0 if stats["failed"] == 0 else 1


def answers(args) -> int:
    from dflash.backends.torch.answer_lanes import Settings, write_answers

    for flag, value in (("--answers", args.answers), ("--lanes", args.lanes), ("--shard-rows", args.shard_rows),
                        ("--max-answer-tokens", args.max_answer_tokens)):
        if value < 1:
            raise DFlashError(f"{flag}: got {value}, expected >= 1")
    if not 0 <= args.sampled_fraction <= 1:
        raise DFlashError(f"--sampled-fraction: got {args.sampled_fraction}, expected a fraction in [0, 1]")
    settings = Settings(max_answer_tokens=args.max_answer_tokens, answer_temperature=args.answer_temperature,
                        sampled_fraction=args.sampled_fraction)
    stats = write_answers(hub.resolve(args.model, "--model"), args.out, answers=args.answers, lanes=args.lanes,
                          settings=settings, exclude=args.exclude, seed=args.seed, shard_rows=args.shard_rows,
                          device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                          progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(stats))
    return 0


def draft_vocab(args) -> int:
    from dflash.backends.torch import write_draft_vocab

    check_output_dir(args.out, "--out")
    model_dir = hub.resolve(args.model, "--model")
    samples = load_samples(args.data, load_tokenizer(model_dir, args.trust_remote_code), max_length=args.max_length,
                           enable_thinking=args.enable_thinking)
    stats = write_draft_vocab(model_dir, hub.resolve(args.draft, "--draft"), samples, args.size, args.out,
                              trust_remote_code=args.trust_remote_code)
    print(json.dumps({"out": str(args.out), **stats}))
    return 0


def cache_features(args) -> int:
    import torch

    from dflash.backends.torch import DTYPES, load_target, resolve_device, resolve_dtype, write_feature_cache

    if args.feature_dtype not in DTYPES:
        raise DFlashError(f"--feature-dtype: got {args.feature_dtype!r}, expected one of {', '.join(DTYPES)}")
    if args.top_k < 0:
        raise DFlashError(f"--top-k: got {args.top_k}, expected 0 (none) or a positive number of tokens")
    check_output_dir(args.out, "--out")
    model_dir = hub.resolve(args.model, "--model")
    tokenizer = load_tokenizer(model_dir, args.trust_remote_code)
    samples = load_samples(args.data, tokenizer, max_length=args.max_length, enable_thinking=args.enable_thinking)
    device = resolve_device(args.device)
    model = load_target(model_dir, resolve_dtype(args.dtype, device), device, args.trust_remote_code)
    n_layers = model.config.get_text_config().num_hidden_layers
    if args.target_layer_ids:
        try:
            layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            raise DFlashError(f"--target-layer-ids: expected comma-separated integers, got "
                              f"{args.target_layer_ids!r}") from None
        bad = [i for i in layer_ids if not 0 <= i < n_layers]
        if bad:
            raise DFlashError(f"--target-layer-ids: {bad} out of range for a target with {n_layers} layers")
    else:
        layer_ids = default_target_layer_ids(n_layers, args.num_layers)
    with torch.inference_mode():
        write_feature_cache(model, samples, layer_ids, args.out, shard_bytes=int(args.shard_gb * 2**30),
                            dtype=DTYPES[args.feature_dtype], device=device, target=str(args.model),
                            top_k=args.top_k, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"out": str(args.out), "samples": len(samples), "target_layer_ids": layer_ids}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
