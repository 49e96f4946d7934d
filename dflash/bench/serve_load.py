"""python -m dflash.bench serve: load on `python -m dflash.serve` at several concurrencies, DFlash against the same
server with --no-draft (the autoregressive baseline, same server code).

Every mode's server process is started on a free 127.0.0.1 port; at each concurrency C, mode after mode, C client
threads send --requests streamed completions in total (greedy, --max-tokens each, prompts cycled from --prompts).
Per request:
time to first token (request sent -> first text chunk), inter-token latency ((last chunk - first chunk) /
(tokens - 1)), the longest gap between two of its chunks (a stall: a joining request's prefill shows here) and the
server's tau; per level: output tokens per second over the level's wall time, the speedup of each mode over
no-draft at the same concurrency, and percentiles of the gap before each token over every token of every request (a
chunk that carries k tokens gives its first token the gap since the previous chunk and the other k - 1 a gap of 0:
they reached the client together). Writes serve.json (also every response: prompt, tokens, chunks, tau, TTFT, ITL,
gap), serve.md (one row per concurrency, the modes side by side) and serve.png (speedup against concurrency, then
throughput, TTFT and the p99 token gap) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import cli
from ..core.errors import DFlashError
from ..core.io import atomic_write_text
from ..core.extras.plots import can_plot, pyplot, save
from .prompts import prompt_rows
from .report import machine_info

# dflash: the server's defaults (--verify auto); the fixed verify modes for comparison, on request
MODES = {"dflash": [], "no-draft": ["--no-draft"], "chain": ["--verify", "chain"], "tree": ["--verify", "tree"]}


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.bench serve", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target for the server (default: the bundled pair)")
    p.add_argument("--draft", help="drafter for the server (default: registry / bundled)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per level, the modes alternating; throughput is the median round's (default: 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--prompts", default="reference", help="reference, humaneval or a JSONL file with 'prompt'")
    p.add_argument("--modes", nargs="+", default=["dflash", "no-draft"], choices=list(MODES),
                   help="servers to load, side by side (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server (default: %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], help="extra dflash.serve flag (repeatable)")
    p.add_argument("--out", default="runs/serve_bench", help="output directory (default: %(default)s)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, mode: str, log_path: Path):
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "dflash.serve", "--port", str(port), "--max-batch", str(max(args.concurrency)),
           "--max-queue", str(max(args.requests, 1)), *MODES[mode], *args.server_arg]
    if args.model:
        cmd += ["--model", args.model]
    if args.draft and mode != "no-draft":
        cmd += ["--draft", args.draft]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DFlashError(f"dflash.serve ({mode}) exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise DFlashError(f"dflash.serve ({mode}) not ready after 600 s; see {log_path}")


def one_request(client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []  # between consecutive text chunks
    usage: dict = {}
    stats: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # a failure after the 200: the server's error event ends the stream
                return {"error": chunk["error"].get("message", "stream error")}
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last, first = now, first or now
            usage, stats = chunk.get("usage") or usage, chunk.get("dflash") or stats
    if "completion_tokens" not in usage:
        return {"error": "stream ended without usage"}
    tokens = usage["completion_tokens"]
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": tokens, "tau": stats.get("tau"),
            "gap": max(gaps, default=0.0), "chunks": len(gaps) + (first is not None), "chunk_gaps": gaps,
            "itl": (last - first) / (tokens - 1) if first and last and tokens > 1 else None}


def token_gaps(response: dict) -> list[float]:
    """The gap before each token after the first: one per chunk after the first, and 0 for every token that arrived
    in a chunk beside another (tokens - chunks of them)."""
    return response["chunk_gaps"] + [0.0] * max(0, response["tokens"] - response["chunks"])


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_level(url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> dict:
    """One round: n requests from `concurrency` clients; the responses and the round's wall time. The clients share
    one connection pool, as an application's HTTP client does (a new httpx client per request cost 37 ms per
    request on this machine, a kept connection 1.7 ms: it showed in every TTFT)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=600, limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        out = list(pool.map(lambda i: {"prompt": i % len(prompts),
                                       **one_request(client, url, prompts[i % len(prompts)], max_tokens)}, range(n)))
    return {"responses": out, "wall_seconds": time.perf_counter() - t0}


def summarise(concurrency: int, rounds: list[dict]) -> dict:
    """A level over its rounds: throughput is the median round's (a round disturbed by the machine does not move
    it), latencies are percentiles over every request of every round."""
    out = [r for rnd in rounds for r in rnd["responses"]]
    ok = [r for r in out if "error" not in r]
    rates = sorted(sum(r["tokens"] for r in rnd["responses"] if "error" not in r) / rnd["wall_seconds"]
                   for rnd in rounds if rnd["wall_seconds"] > 0)
    taus = [r["tau"] for r in ok if r["tau"]]
    gaps = [g for r in ok for g in token_gaps(r)]
    return {"concurrency": concurrency, "requests": len(out), "failed": len(out) - len(ok),
            "wall_seconds": sum(rnd["wall_seconds"] for rnd in rounds), "output_tokens": sum(r["tokens"] for r in ok),
            "tokens_per_second": rates[len(rates) // 2] if rates else 0.0, "round_tokens_per_second": rates,
            "ttft_p50": _pct([r["ttft"] for r in ok], 0.5), "ttft_p99": _pct([r["ttft"] for r in ok], 0.99),
            "itl_p50": _pct([r["itl"] for r in ok], 0.5), "itl_p99": _pct([r["itl"] for r in ok], 0.99),
            "gap_p99": _pct([r["gap"] for r in ok], 0.99),
            "token_gap_p50": _pct(gaps, 0.5), "token_gap_p90": _pct(gaps, 0.9), "token_gap_p99": _pct(gaps, 0.99),
            "tau": sum(taus) / len(taus) if taus else None,
            "responses": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k != "chunk_gaps"}
                          for r in out]}


def speedups(report: dict, base: str = "no-draft") -> dict[str, dict[int, float]]:
    """Per mode and concurrency: its throughput over the baseline's at the same concurrency (levels both ran)."""
    modes = report["modes"]
    if base not in modes:
        return {}
    base_tps = {lv["concurrency"]: lv["tokens_per_second"] for lv in modes[base]}
    return {mode: {lv["concurrency"]: lv["tokens_per_second"] / base_tps[lv["concurrency"]]
                   for lv in levels if base_tps.get(lv["concurrency"])}
            for mode, levels in modes.items() if mode != base}


def rounds_note(rounds: int) -> str:
    return "" if rounds == 1 else (f" and round, {rounds} rounds with the modes alternating (throughput: the median "
                                   "round's; latencies: over every round's requests)")


def markdown(report: dict) -> str:
    modes = list(report["modes"])
    ratio = speedups(report)
    lines = ["# dflash.serve under load", "", f"`{report['command']}`", "",
             f"Machine: {report['machine']['cpu']} ({report['machine']['nproc']} CPUs), server threads "
             f"{report['threads']}; {report['requests']} greedy requests of {report['max_tokens']} tokens per level"
             f"{rounds_note(report.get('rounds', 1))}. "
             "Speedup: output tokens per second over no-draft's at the same concurrency. ITL: per request, (last "
             "chunk - first chunk) / (tokens - 1); token gap: the wait before each token, over every token (tokens "
             "that arrive in one chunk after the first wait 0); stall: the longest gap between two chunks of one "
             "request.", ""]

    def ms(x):
        return "—" if x is None else f"{1000 * x:.1f}"

    def pair(levels, key, fmt):
        return " / ".join(fmt(lv.get(key)) if lv else "—" for lv in levels)

    header = ["concurrency", *(f"{m} speedup" for m in ratio), *(f"{m} tok/s" for m in modes), "tau",
              "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)", "token gap p99 (ms)", "stall p99 (ms)",
              "failed"]
    lines += [f"Cells with several values list the modes in the order {' / '.join(modes)}.", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_level = {m: {lv["concurrency"]: lv for lv in report["modes"][m]} for m in modes}
    for c in sorted({c for levels in by_level.values() for c in levels}):
        levels = [by_level[m].get(c) for m in modes]
        cells = [str(c), *(f"**{ratio[m][c]:.2f}x**" if c in ratio[m] else "—" for m in ratio),
                 *("—" if lv is None else f"{lv['tokens_per_second']:.1f}" for lv in levels),
                 pair(levels, "tau", lambda x: "—" if x is None else f"{x:.2f}"),
                 pair(levels, "ttft_p50", ms), pair(levels, "ttft_p99", ms), pair(levels, "itl_p50", ms),
                 pair(levels, "itl_p99", ms), pair(levels, "token_gap_p99", ms), pair(levels, "gap_p99", ms),
                 pair(levels, "failed", str)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = pyplot("serve plot")
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for mode, by_c in speedups(report).items():
        axes[0].plot(list(by_c), list(by_c.values()), "o-", label=mode)
    axes[0].axhline(1.0, color="grey", linestyle="--", linewidth=1, label="no-draft")
    for mode, levels in report["modes"].items():
        c = [lv["concurrency"] for lv in levels]
        axes[1].plot(c, [lv["tokens_per_second"] for lv in levels], "o-", label=mode)
        axes[2].plot(c, [1000 * (lv["ttft_p50"] or 0) for lv in levels], "o-", label=mode)
        axes[3].plot(c, [1000 * (lv.get("token_gap_p99") or 0) for lv in levels], "o-", label=mode)
    titles = ["speedup over no-draft (tok/s ratio)", "output tokens / s", "time to first token p50 (ms)",
              "gap before a token, p99 over tokens (ms)"]
    levels = sorted({lv["concurrency"] for lvs in report["modes"].values() for lv in lvs})
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    save(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(c < 1 for c in args.concurrency) or min(args.requests, args.max_tokens, args.rounds) < 1:
        raise DFlashError("--concurrency / --requests / --max-tokens / --rounds: expected integers >= 1")
    prompts = [r["prompt"] for r in prompt_rows(args.prompts) if "prompt" in r]
    if not prompts:
        raise DFlashError(f"--prompts: {args.prompts} has no 'prompt' rows (completions need plain prompts)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python -m dflash.bench serve " + " ".join(argv if argv is not None else sys.argv[2:]),
              "machine": machine_info(), "threads": args.threads, "requests": args.requests,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "modes": {}}
    servers = {}
    try:
        for mode in args.modes:  # every mode's server is up at once: the levels interleave, drift hits all alike
            servers[mode] = start_server(args, mode, out / f"server-{mode}.log")
            run_level(servers[mode][1], prompts, 1, 1, 8)  # warm-up
            report["modes"][mode] = []
        for c in args.concurrency:
            rounds: dict[str, list] = {mode: [] for mode in servers}
            for _ in range(args.rounds):  # mode after mode, round after round: drift hits every mode alike
                for mode, (_, url) in servers.items():
                    rounds[mode].append(run_level(url, prompts, c, args.requests, args.max_tokens))
            for mode in servers:
                level = summarise(c, rounds[mode])
                report["modes"][mode].append(level)
                print(f"{mode} c={c}: {level['tokens_per_second']:.1f} tok/s, TTFT p50 "
                      f"{1000 * (level['ttft_p50'] or 0):.0f} ms, tau {level['tau'] or 0:.2f}", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    atomic_write_text(out / "serve.md", markdown(report))
    if can_plot("bench serve"):
        plot(report, out / "serve.png")
    report["speedup"] = {m: {str(c): round(x, 3) for c, x in by_c.items()} for m, by_c in speedups(report).items()}
    atomic_write_text(out / "serve.json", json.dumps(report, indent=2) + "\n")
    print(json.dumps({"out": str(out), "speedup": report["speedup"]}))
    return 0
