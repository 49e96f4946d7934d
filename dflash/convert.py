"""python -m dflash.convert: check a drafter against a target, and convert checkpoints.

    check          --model DIR --draft DIR            compatibility report (no generation); non-zero on mismatch
    dtype          --draft DIR --out DIR --dtype T    canonical drafter in float32 / bfloat16 / float16
    quantize       --draft DIR --out DIR --bits 4     MLX-quantized drafter (loaded by --backend mlx only)
    target-to-mlx  --model DIR --out DIR [--quantize --bits 4]   mlx-lm's own converter
    strip-prefix   --draft DIR --out DIR [--prefix P] remove a trainer's key prefix ('model.', '_orig_mod.', ...)
    gguf           --gguf FILE --out DIR [--dtype T]  a llama.cpp GGUF target -> a transformers directory (float32)
"""

from __future__ import annotations

import argparse
import json
import sys

from . import cli, hub
from .converters import compat, draft, gguf, quantize, target


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.convert", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, help):
        s = sub.add_parser(name, help=help)
        s.add_argument("--debug", action="store_true", help="full tracebacks")
        return s

    s = command("check", "is this drafter compatible with this target?")
    s.add_argument("--model", required=True, help="target: directory or hub id")
    s.add_argument("--draft", required=True, help="drafter: directory or hub id")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s = command("dtype", "rewrite a drafter in another floating-point dtype")
    s.add_argument("--draft", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dtype", required=True, choices=["float32", "bfloat16", "float16"])
    s = command("quantize", "MLX-quantize a drafter")
    s.add_argument("--draft", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--bits", type=int, default=4, help="4 or 8 (also 2, 3, 5, 6)")
    s.add_argument("--group-size", type=int, default=64)
    s = command("target-to-mlx", "convert a transformers target for MLX with mlx-lm")
    s.add_argument("--model", required=True, help="target: directory or hub id")
    s.add_argument("--out", required=True)
    s.add_argument("--quantize", action="store_true")
    s.add_argument("--bits", type=int, default=4)
    s.add_argument("--group-size", type=int, default=64)
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--trust-remote-code", action="store_true")
    s = command("strip-prefix", "remove a trainer's key prefix from a drafter's weight names")
    s.add_argument("--draft", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--prefix", help="the prefix to remove (default: detect 'model.', '_orig_mod.', 'module.', ...)")
    s = command("gguf", "dequantize a GGUF target into a transformers directory (through transformers)")
    s.add_argument("--gguf", required=True, help="the .gguf file")
    s.add_argument("--out", required=True)
    s.add_argument("--dtype", default="float32", choices=list(gguf.DTYPES))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "check":
        report = compat.check(hub.resolve(args.model, "--model"), hub.resolve(args.draft, "--draft"))
        print(json.dumps(report) if args.json else "\n".join(compat.report_lines(report)))
    elif args.command == "dtype":
        print(draft.convert_dtype(args.draft, args.out, args.dtype))
    elif args.command == "quantize":
        print(quantize.quantize_drafter(args.draft, args.out, bits=args.bits, group_size=args.group_size))
    elif args.command == "target-to-mlx":
        print(target.target_to_mlx(hub.resolve(args.model, "--model"), args.out, quantize=args.quantize,
                                   bits=args.bits, group_size=args.group_size, dtype=args.dtype,
                                   trust_remote_code=args.trust_remote_code))
    elif args.command == "strip-prefix":
        print(draft.strip_prefix(args.draft, args.out, prefix=args.prefix))
    elif args.command == "gguf":
        print(gguf.convert_gguf(args.gguf, args.out, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
