"""Benchmark workers: every method in its own process (peak RSS per method), JSON lines both ways; interleaved
prompt by prompt so that machine-load drift hits every method alike, or one method at a time (--sequential);
with --processes, several processes per method, the prompts dealt among them.
With repeats, every prompt runs that many times per method (interleaved: the whole prompt list, then again) and a
prompt's timings are the median over its runs: one disturbed run no longer moves that prompt's speedup."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..core.extras.blas import openblas_path
from .methods import Method

OPENBLAS = str(openblas_path())  # Debian's libopenblas0-pthread, or $DFLASH_OPENBLAS


class WorkerFailed(Exception):
    pass


class Worker:
    """One method in its own process (python -m dflash.bench.worker), JSON lines both ways."""

    def __init__(self, method: Method, cfg: dict, env: dict, log_path: Path, index: int = 0):
        self.method, self.index = method, index  # index: which of the method's processes (--processes)
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.bench.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True, bufsize=1)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # (both piped)
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self._exit_sent = False
        self.send(cfg)
        self.ready: dict | None = None
        self.done: dict = {}

    def send(self, obj: dict) -> None:
        try:
            self.stdin.write(json.dumps(obj) + "\n")
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(self._why()) from None

    def recv(self) -> dict:
        line = self.stdout.readline()
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
            if self.proc.poll() is None and not self.stdin.closed:
                self.send({"cmd": "exit"})
                self._exit_sent = True
        except WorkerFailed:
            pass

    def close(self) -> None:
        try:
            if not self._exit_sent:
                self.request_exit()
            if self._exit_sent:
                self.done = self.recv()
        except WorkerFailed:
            pass
        finally:
            try:
                self.stdin.close()
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
    pkg_root = method.code or str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([p for p in (pkg_root, env.get("PYTHONPATH")) if p])
    return env


TIMINGS = ("seconds", "prefill_seconds", "decode_seconds")
COUNTS = ("acceptance_lengths", "verified")  # per cycle: every run's cycles are pooled


def merge_runs(runs: list[dict]) -> dict:
    """One prompt's record from its repeated runs: the first run's tokens, each timing the median over the runs
    (with every run's seconds kept), the runs' cycles pooled, and whether any run's tokens differed from the first's."""
    if len(runs) == 1 or any("error" in r for r in runs):
        return next((r for r in runs if "error" in r), runs[0])
    first = runs[0]
    merged = dict(first, run_seconds=[r["seconds"] for r in runs], run_processes=[r.get("process") for r in runs],
                  runs_differ=any(r["tokens"] != first["tokens"] for r in runs))
    for k in TIMINGS:
        if k in first:
            merged[k] = statistics.median(r[k] for r in runs)
    for k in COUNTS:
        if first.get(k) is not None:
            merged[k] = [x for r in runs for x in r[k]]
    if first.get("cycles_without_draft") is not None:
        merged["cycles_without_draft"] = sum(r["cycles_without_draft"] for r in runs)
    return merged


def run_methods(methods: list[Method], base_cfg: dict, prompts: list[dict], out: Path, *, sequential: bool,
                openblas: bool, seed: int, progress: bool, repeats: int = 1, processes: int = 1, log=print) -> dict:
    """{method name: {"records": [record or None per prompt], "ready": ..., "done": ..., "error": ...}}.
    processes: worker processes per method, run r of the i-th prompt (batch, with batch_size > 1) on process
    (i + r) % processes. One process of a method can run 5-25% faster than another for its whole life (a 2-core
    Xeon, the same plain decoder in fresh processes: 5.0-6.4 ms a token), which one process per method makes the
    method's; dealt over several, it is averaged."""
    from tqdm import tqdm

    (out / "logs").mkdir(parents=True, exist_ok=True)
    batch_size = base_cfg.get("batch_size", 1)
    results: dict[str, dict[str, Any]] = {m.name: {"records": [None] * len(prompts), "error": None} for m in methods}
    runs: dict[str, list[list[dict]]] = {m.name: [[] for _ in prompts] for m in methods}
    total = len(prompts) * repeats
    bar = tqdm(total=total * len(methods), desc="bench", unit="gen", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)

    def start(m: Method, k: int) -> Worker:
        cfg = dict(base_cfg, method=m.base)
        log_name = f"{m.name}.log" if processes == 1 else f"{m.name}.{k}.log"
        return Worker(m, cfg, worker_env(m, base_cfg["threads"], openblas), out / "logs" / log_name, k)

    def ready(w: Worker) -> bool:
        try:
            r = w.wait_ready()
            record = results[w.method.name]
            record.update(load_seconds=max(record.get("load_seconds", 0.0), r["load_seconds"]),
                          load_rss_bytes=max(record.get("load_rss_bytes", 0), r["load_rss_bytes"]),
                          info=r.get("info", {}))
            return True
        except WorkerFailed as e:
            results[w.method.name]["error"] = str(e)
            log(f"FAILED {w.method.name}: {e}")
            w.close()
            return False

    def started(m: Method) -> list[Worker] | None:
        """The method's processes, loaded one at a time (None, and every one closed, if one failed)."""
        workers: list[Worker] = []
        for k in range(processes):
            w = start(m, k)
            if not ready(w):
                for other in workers:
                    other.close()
                bar.update(total)
                return None
            workers.append(w)
        return workers

    def finish(w: Worker) -> None:
        w.close()
        for k in ("peak_rss_bytes", "cuda_peak_bytes", "mlx_peak_bytes"):
            if k in w.done:
                record = results[w.method.name]
                record[k] = max(record.get(k, 0), w.done[k])

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
            rec["process"] = w.index
            runs[w.method.name][j].append(rec)
        bar.update(len(batch))
        return True

    # (run r of prompt start i, on process (i // batch_size + r) % processes)
    starts = [(r, i) for r in range(repeats) for i in range(0, len(prompts), batch_size)]
    which = lambda r, i: (i // batch_size + r) % processes  # noqa: E731
    try:
        if sequential:
            for m in methods:
                workers = started(m)
                if workers is None:
                    continue
                for n, (r, i) in enumerate(starts):
                    if not step(workers[which(r, i)], i, prompts[i]):
                        bar.update(total - n * batch_size)
                        break
                for w in workers:
                    finish(w)
        else:
            # one worker loads (and warms up, and measures its cost profile) at a time: a profile measured while
            # another worker loads on the same cores would be a busy machine's, and auto would plan with it
            live = {m.name: ws for m in methods if (ws := started(m)) is not None}
            for n, (r, i) in enumerate(starts):
                for name, workers in list(live.items()):
                    if not step(workers[which(r, i)], i, prompts[i]):
                        bar.update(total - n * batch_size)
                        del live[name]
                        for w in workers:
                            w.close()
            for workers in live.values():
                for w in workers:
                    w.request_exit()
            for workers in live.values():
                for w in workers:
                    finish(w)
    finally:
        bar.close()
    for name, per_prompt in runs.items():
        results[name]["records"] = [merge_runs(rs) if rs else None for rs in per_prompt]
    return results
