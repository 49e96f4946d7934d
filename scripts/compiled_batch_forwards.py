"""Whether torch.compile pays for batched decoding forwards on this device: the target's forward of `rows` rows x
`tokens` tokens after `context` cached positions, eager against compiled (fullgraph, dynamic=None), both on the
same windowed static cache, a mask and explicit positions as the engine's batched forwards pass them.

    python scripts/compiled_batch_forwards.py --rows 1 8 16 32 --tokens 1 2 4 --out compiled_batches.json

The engine compiles single streams (`--compile`) and runs batches eagerly on its row-owning cache; this measures what
compiling the batched forwards could win at best (no row bookkeeping timed), the figures docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, StaticCache

from dflash.backends.torch.kv_cache import set_window, window_of, windowed
from dflash.bench.report import machine_info
from dflash.reference import TARGET_DIR


def median_ms(model, cache, ids, positions, mask, iters: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(iters):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                  logits_to_keep=0)
            times.append(time.perf_counter() - start)
            cache.crop(-ids.shape[1])
    return 1e3 * statistics.median(times)


def forward_ms(model, compiled, rows: int, tokens: int, context: int, iters: int) -> tuple[float, float, float]:
    """(eager ms, compiled ms, seconds the compiled one took to compile) for one shape."""
    cache = windowed(StaticCache(config=model.config, max_cache_len=4 * 256))
    vocab = model.config.vocab_size
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (rows, context)), cache=cache, use_cache=True)  # eager prefill
    set_window(cache, context + tokens)
    window = window_of(cache)
    ids = torch.randint(0, vocab, (rows, tokens))
    positions = (context + torch.arange(tokens))[None].expand(rows, -1)
    mask = (torch.arange(window)[None] <= positions[0][:, None])[None, None].expand(rows, 1, tokens, window)
    eager = median_ms(model, cache, ids, positions, mask, iters)
    start = time.perf_counter()
    median_ms(compiled, cache, ids, positions, mask, 2)
    compile_s = time.perf_counter() - start
    return eager, median_ms(compiled, cache, ids, positions, mask, iters), compile_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(TARGET_DIR), help="target directory (default: the bundled target)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    compiled = torch.compile(model, dynamic=None, fullgraph=True)
    results = []
    for rows in args.rows:
        for tokens in args.tokens:
            eager, fast, compile_s = forward_ms(model, compiled, rows, tokens, args.context, args.iters)
            results.append(dict(rows=rows, tokens=tokens, eager_ms=eager, compiled_ms=fast, speedup=eager / fast,
                                compile_seconds=compile_s))
            print(f"rows {rows:3d} x tokens {tokens}: eager {eager:7.2f} ms  compiled {fast:7.2f} ms  "
                  f"{eager / fast:.2f}x  (compile {compile_s:.0f} s)", flush=True)
    if args.out:
        machine = dict(machine_info(), threads=args.threads, context=args.context, model=args.model)
        with open(args.out, "w") as f:
            json.dump(dict(machine=machine, results=results), f, indent=1)


if __name__ == "__main__":
    main()
