"""python -m dflash.generate: one prompt in, one generation out (text stream, or one JSON object with --json)."""

from __future__ import annotations

import json
import sys

from . import cli
from .core.errors import DFlashError
from .core.output import summary_line
from .core.model_files.tokenizer import chat_ids


BUNDLED_PAIR_NOTE = ("dflash: the bundled pair is an 8.4M-parameter toy trained on Python source (for offline runs, "
                     "tests and benchmarks): expect Python-shaped text; --model Qwen/Qwen3-8B runs a real model")


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.generate", description=__doc__)
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--trace", action="store_true", help="with --json: the drafted tokens of every cycle")
    return p.parse_args(argv)


def prompt_ids_from(args, pipe) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise DFlashError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from None
        vocab = pipe.engine.info.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DFlashError(f"--prompt-ids: id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids
    text = args.prompt if args.prompt is not None else (sys.stdin.read() if not sys.stdin.isatty() else "")
    if not text:
        raise DFlashError("--prompt: empty prompt; pass --prompt TEXT, --prompt-ids, or pipe text on stdin")
    if args.chat:
        return chat_ids(pipe.tokenizer, [{"role": "user", "content": text}], args.system)
    return pipe.encode(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    sampling = cli.sampling_from(args)
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens: got {args.max_new_tokens}, expected >= 1")
    pipe = cli.load_pipeline(args)
    sampling = cli.sampling_from(args, pipe.engine.info.vocab_size)  # (--logit-bias ids, now the vocabulary is known)
    ids = prompt_ids_from(args, pipe)
    gen = pipe.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop, trace=args.trace)
    if args.json:
        result = gen.run()
        print(json.dumps(result.to_json(trace=args.trace)))
        return 0
    if args.model is None:
        print(BUNDLED_PAIR_NOTE, file=sys.stderr, flush=True)
    for inc in gen:
        sys.stdout.write(inc.text)
        sys.stdout.flush()
    r = gen.result
    sys.stdout.write("\n")
    print(summary_line(r.mean_acceptance_length, r.decode_tokens_per_second, r.generation_tokens,
                       r.prefill_seconds), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
