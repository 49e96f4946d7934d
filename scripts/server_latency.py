"""Per-token latency at concurrency 1: python -m dflash.serve against dflash.api's generate() in process, on the
same prompts, prompt by prompt (one after the other, never at once: drift hits both alike). Both run one thread and
the bundled pair (or --model / --draft) under the default --verify auto; the server's time is the whole HTTP
request (templating, tokenising, streaming and detokenising included), generate()'s the whole call. Greedy texts
must be equal.

    OMP_NUM_THREADS=1 python scripts/server_latency.py --prompts reference --num-prompts 16 --max-tokens 128 \
        [--out docs/server_latency.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from dflash.api import load
from dflash.bench.prompts import prompt_rows
from dflash.bench.serve_load import start_server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--prompts", default="reference")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out")
    args = p.parse_args()
    prompts = [r["prompt"] for r in prompt_rows(args.prompts) if "prompt" in r][: args.num_prompts]
    pipe = load(args.model, args.draft)
    server_args = SimpleNamespace(concurrency=[1], requests=1, server_arg=[], model=args.model, draft=args.draft,
                                  threads=1)
    log = Path(args.out).with_suffix(".server.log") if args.out else Path("/dev/null")
    proc, url = start_server(server_args, "dflash", log)
    client = httpx.Client(timeout=600)  # one connection pool, as an application keeps
    rows = []
    try:
        def served(prompt: str) -> tuple[float, int, str]:
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions",
                            json={"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})
            seconds = time.perf_counter() - t0
            body = r.json()
            return seconds, body["usage"]["completion_tokens"], body["choices"][0]["text"]

        def direct(prompt: str) -> tuple[float, int, str]:
            t0 = time.perf_counter()
            result = pipe.generate(prompt, max_new_tokens=args.max_tokens)
            return time.perf_counter() - t0, len(result.tokens), result.text

        served(prompts[0])  # warm-up, both
        direct(prompts[0])
        for i, prompt in enumerate(prompts):
            (s_sec, s_tok, s_text), (d_sec, d_tok, d_text) = served(prompt), direct(prompt)
            rows.append({"prompt": i, "server_ms_per_token": 1000 * s_sec / max(s_tok, 1),
                         "generate_ms_per_token": 1000 * d_sec / max(d_tok, 1), "tokens": [s_tok, d_tok],
                         "same_text": s_text == d_text})
            print(f"{i}: server {rows[-1]['server_ms_per_token']:.2f} ms/token, generate "
                  f"{rows[-1]['generate_ms_per_token']:.2f}", file=sys.stderr)
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)
    ratios = [r["server_ms_per_token"] / r["generate_ms_per_token"] for r in rows]
    report = {"command": "python scripts/server_latency.py " + " ".join(sys.argv[1:]), "prompts": len(rows),
              "server_ms_per_token_median": statistics.median(r["server_ms_per_token"] for r in rows),
              "generate_ms_per_token_median": statistics.median(r["generate_ms_per_token"] for r in rows),
              "server_over_generate_median": statistics.median(ratios),
              "same_text": sum(r["same_text"] for r in rows), "rows": rows}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
