"""What every CLI shares: sampling/model flags and one-line errors (full traceback only with --debug)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from . import backends
from .api import COMPILED_CACHE_LEN, load
from .core.extras import blas
from .core.budget import ITL_LIMIT
from .core.errors import DFlashError, did_you_mean
from .core.sampling import ACCEPT_RULES, CHAIN_ONLY_RULES, SamplingParams


class Parser(argparse.ArgumentParser):
    """The parser of every `python -m dflash.X`: a bad command line is one line that names the closest flag or
    choice (what Python 3.14's suggest_on_error does, on every version), not the usage block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, Parser] = {}

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        self.subcommands = action.choices  # a subcommand's unknown flags are reported by this parser
        return action

    def flags(self) -> set[str]:
        """Every option string of this parser and its subcommands (read from their help)."""
        found = set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", self.format_help()))
        return found.union(*(sub.flags() for sub in self.subcommands.values()))

    def error(self, message: str):
        unknown = re.fullmatch(r"unrecognized arguments: (.*)", message)
        if unknown:
            # the words after an unknown flag are most likely its value: name the flags, else the stray words
            words = unknown[1].split()
            flags = [w.split("=")[0] for w in words if w.startswith("-")]
            if flags:
                known = self.flags()
                message = "; ".join(f"unknown flag {f}" + did_you_mean(f, known) for f in flags)
            else:
                message = f"unexpected argument{'s' * (len(words) > 1)} {' '.join(words)}"
        choice = re.search(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)", message)
        if choice:
            choices = [c.strip(" '\"") for c in choice[2].split(",")]
            message += did_you_mean(choice[1], choices)
        self.exit(2, f"error: {message}; {self.prog} --help lists the flags\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="auto (MLX on Apple silicon, else torch; the installed one "
                   "if only one is), torch or mlx")
    p.add_argument("--model", help="target: local HF directory, hub id, or smollm2 (python -m dflash.models fetch "
                   "smollm2) (default: the bundled reference target)")
    p.add_argument("--draft", help="DFlash drafter: directory or hub id (default: registry / bundled)")
    p.add_argument("--no-draft", action="store_true", help="target-only autoregressive decoding (the baseline)")
    p.add_argument("--block-size", type=int, help="draft block size (default: the drafter's)")
    p.add_argument("--draft-window", type=int, help="bound the drafter's context to the last N positions")
    p.add_argument("--verify", default="auto", choices=("chain", "tree", "auto"),
                   help="chain: verify the drafter's B-1 proposals; tree: a tree of the --tree-budget most probable "
                   "prefixes; auto: per cycle, the node count that is fastest on this device (default: %(default)s)")
    p.add_argument("--tree-budget", type=int, help="draft nodes per verify: tree's size, auto's maximum "
                   "(default: block size - 1 for tree; auto: 255, of which its measured cycles choose fewer)")
    p.add_argument("--no-copy-branch", dest="copy_branch", action="store_false",
                   help="trees without the branch copied from the context (prompt lookup)")
    p.add_argument("--itl-limit", type=float, default=ITL_LIMIT,
                   help="auto, batches: a cycle takes at most this many plain decoding steps per token the row "
                   "least served by it expects, so one row's trees do not slow a row whose drafts are rarely "
                   "accepted (0: no limit; default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda[:N], mps")
    p.add_argument("--compile", action="store_true",
                   help="torch, one stream: a preallocated static cache and torch.compile'd forwards, compiled "
                   "at load (a minute or two the first time; batches need the dynamic cache)")
    p.add_argument("--cache-len", type=int, help="--compile: the static cache's positions, prompt and output "
                   "(default: the target's context, at most %d)" % COMPILED_CACHE_LEN)
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")
    p.add_argument("--debug", action="store_true", help="full tracebacks")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens to generate at most (default: %(default)s; capped to the target's context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: %(default)s = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the top probability (default: %(default)s = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide a logit of a token in the prompt or output so far (default: %(default)s = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logit of every token the output holds so far, -2 .. 2 "
                        "(default: %(default)s = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract, per occurrence in the output so far, -2 .. 2 (default: %(default)s = off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID:BIAS",
                   help="add BIAS (-100 .. 100) to token ID's logit (repeatable; -100 bans the token; default: none)")
    p.add_argument("--seed", type=int, help="sampling seed: the same seed, prompt, model and settings give the same "
                   "tokens on the same machine, whatever the verify mode, budget or batch chose (every draw is "
                   "keyed by the token's position); default: a fresh seed every run")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: EOS only)")
    p.add_argument("--accept", default="auto", choices=ACCEPT_RULES,
                   help="acceptance rule when sampling (docs/sampling.md): match (the draft proposes the token the "
                        "target's own noise picks under the draft's distribution; output = target-only sampling with "
                        "the same seed, chains and trees); rejection, argmax, sharpened (exact rejection sampling "
                        "against the draft's q, its argmax as a one-hot q, or q^(1/t) with --draft-temperature t; "
                        "chains); shaped (rejection with the shape each request's cycles accept best: argmax, "
                        "t = 0.5 or q); multi (trees: several one-hot children per node, recursive rejection; a "
                        "chain verifies like argmax); default: %(default)s = rejection, or match with --seed (its "
                        "promise holds whatever the verify budget chose) or --verify tree")
    p.add_argument("--draft-temperature", type=float, default=0.5,
                   help="--accept sharpened: the drafts come from q^(1/t), t in (0, 1] (default: %(default)s)")


def sampling_from(args, vocab_size: int | None = None) -> SamplingParams:
    """The sampling flags, checked (logit bias ids against vocab_size when given)."""
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logit_bias=logit_bias(args.logit_bias),
                            seed=args.seed, accept=args.accept,
                            draft_temperature=args.draft_temperature).validate(vocab_size)
    if args.verify == "tree" and params.accept in CHAIN_ONLY_RULES and not params.greedy and not args.no_draft:
        raise DFlashError(f"--accept {params.accept} verifies chains only: with --verify tree use --accept match or "
                          "multi, or --verify chain / auto")
    return params


def logit_bias(values: list[str]) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID:BIAS values as (token id, bias) pairs."""
    pairs = []
    for value in values:
        token, _, bias = value.partition(":")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise DFlashError(f"--logit-bias: got {value!r}, expected TOKEN_ID:BIAS (e.g. 42:-100)") from None
    return tuple(pairs)


def restart_if_mlx(args) -> None:
    """An MLX run re-executes itself with OpenBLAS preloaded where it can (dflash.core.extras.blas). LD_PRELOAD only acts at
    process start, and the new process must find stdin unread: call this before any work and before reading stdin."""
    if backends.pick(args.backend) == "mlx":
        blas.restart_mlx_run_with_openblas()


def load_pipeline(args):
    if args.draft_window is not None and args.draft_window < 1:
        raise DFlashError(f"--draft-window: got {args.draft_window}, expected >= 1")
    restart_if_mlx(args)
    return load(args.model, args.draft, backend=args.backend, no_draft=args.no_draft, dtype=args.dtype,
                device=args.device, block_size=args.block_size, draft_window=args.draft_window,
                trust_remote_code=args.trust_remote_code, verify=args.verify, tree_budget=args.tree_budget,
                copy_branch=args.copy_branch, itl_limit=args.itl_limit, compile=args.compile,
                cache_len=args.cache_len)


def run(main, argv=None) -> int:
    """Run a CLI main(argv); a DFlashError becomes one line on stderr and exit status 2."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        code = main(argv) or 0
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        # the reader went away (`... | head`): stop quietly, as a C tool killed by SIGPIPE would; stdout goes to
        # /dev/null so that Python's own flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except DFlashError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
