"""The methods `python -m dflash.bench` compares, and the worker process each one runs in.

Every method is a `Runner`: it loads its models once and turns prompt token ids into one record per prompt
(`tokens`, `seconds`, `prefill_seconds`, `decode_seconds`, `acceptance_lengths`). The benchmark runs each method in
its own worker process (`python -m dflash.bench.worker`, JSON lines on stdin/stdout), so every method gets its own
peak-RSS figure, and MLX methods can run with OpenBLAS preloaded while torch methods never are.

    family   backend  what runs
    dflash   torch    this project's loop on the PyTorch backend (no drafter = the autoregressive baseline)
    dflash   mlx      this project's loop on the MLX backend
    hf       torch    transformers `generate()`: plain, prompt lookup, or assisted with an autoregressive draft
    mlx_lm   mlx      mlx-lm `stream_generate()`: plain, or speculative with an autoregressive draft

Timing: `seconds` is the wall time of the whole generation call (prefill included); `prefill_seconds` is the time
until the first generated tokens come out (for the speculative peers that includes their first draft/verify cycle,
whose tokens come out together), `decode_seconds` the rest, and `decode_tokens` the tokens produced in it.
`acceptance_lengths` holds the tokens committed per verification cycle (accepted draft tokens + 1), or None for
autoregressive methods.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from .. import api
from ..core.errors import DFlashError
from ..core.sampling import SamplingParams
from ..core.model_files.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Method:
    name: str
    family: str  # dflash | hf | mlx_lm
    backend: str  # torch | mlx  (the greedy-equality group and its baseline)
    block_size: int | None = None  # dflash: None = no drafter
    lookup: bool = False  # hf: prompt lookup decoding
    ar_draft: bool = False  # hf assisted / mlx-lm speculative: needs the autoregressive draft model
    verify: str = "chain"  # dflash: chain | tree | auto (dflash/core/budget.py)
    copy_branch: bool = True  # dflash trees: the branch copied from the context
    compile: bool = False  # dflash, torch: static cache + torch.compile (dflash.load(compile=True))
    label: str = ""
    code: str | None = None  # another checkout of this project whose code the worker runs (NAME@DIR: a change A/B'd)

    @property
    def base(self) -> str:
        """The method's name in METHODS (without @DIR)."""
        return self.name.split("@")[0]

    @property
    def speculative(self) -> bool:
        return self.block_size is not None or self.lookup or self.ar_draft


METHODS = {m.name: m for m in (
    Method("no_draft", "dflash", "torch", label="target only, autoregressive (PyTorch baseline)"),
    Method("dflash_b16", "dflash", "torch", block_size=16, label="DFlash, block 16 (PyTorch)"),
    Method("dflash_b8", "dflash", "torch", block_size=8, label="DFlash, block 8 (PyTorch)"),
    Method("no_draft_compiled", "dflash", "torch", compile=True,
           label="target only, autoregressive, static cache + torch.compile (PyTorch)"),
    Method("dflash_b16_compiled", "dflash", "torch", block_size=16, compile=True,
           label="DFlash, block 16, static cache + torch.compile (PyTorch)"),
    Method("dflash_tree_compiled", "dflash", "torch", block_size=16, verify="auto", compile=True,
           label="DFlash, block 16, verify auto, static cache + torch.compile (PyTorch)"),
    Method("dflash_tree", "dflash", "torch", block_size=16, verify="auto",
           label="DFlash, block 16, verify auto: tree / chain / budget per cycle (PyTorch)"),
    Method("dflash_tree_nocopy", "dflash", "torch", block_size=16, verify="auto", copy_branch=False,
           label="DFlash, block 16, verify auto without the copied branch (PyTorch)"),
    Method("dflash_fixed_tree", "dflash", "torch", block_size=16, verify="tree",
           label="DFlash, block 16, a fixed tree of --tree-budget nodes (default 15) every cycle (PyTorch)"),
    Method("hf_no_draft", "hf", "torch", label="transformers generate(), autoregressive"),
    Method("prompt_lookup", "hf", "torch", lookup=True, label="transformers prompt lookup decoding"),
    Method("assisted", "hf", "torch", ar_draft=True, label="transformers assisted generation (AR draft)"),
    Method("mlx_no_draft", "dflash", "mlx", label="target only, autoregressive (MLX baseline)"),
    Method("mlx_dflash_b16", "dflash", "mlx", block_size=16, label="DFlash, block 16 (MLX)"),
    Method("mlx_dflash_b8", "dflash", "mlx", block_size=8, label="DFlash, block 8 (MLX)"),
    Method("mlx_dflash_tree", "dflash", "mlx", block_size=16, verify="auto",
           label="DFlash, block 16, verify auto: tree / chain / budget per cycle (MLX)"),
    Method("mlx_dflash_tree_nocopy", "dflash", "mlx", block_size=16, verify="auto", copy_branch=False,
           label="DFlash, block 16, verify auto without the copied branch (MLX)"),
    Method("mlx_dflash_fixed_tree", "dflash", "mlx", block_size=16, verify="tree",
           label="DFlash, block 16, a fixed tree of --tree-budget nodes (default 15) every cycle (MLX)"),
    Method("mlx_lm_no_draft", "mlx_lm", "mlx", label="mlx-lm stream_generate(), autoregressive"),
    Method("mlx_lm_speculative", "mlx_lm", "mlx", ar_draft=True, label="mlx-lm speculative decoding (AR draft)"),
)}
BASELINES = {"torch": "no_draft", "mlx": "mlx_no_draft"}


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else ""
    if isinstance(e, DFlashError):
        return msg
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def cycles_from_draft_flags(from_draft: list[bool]) -> list[int]:
    """mlx-lm yields each cycle's accepted draft tokens (from_draft=True) then the target's own token: the cycle
    lengths are the runs of True closed by a False. A run cut by max_tokens counts as a (shorter) cycle."""
    lengths, run = [], 0
    for flag in from_draft:
        run += 1
        if not flag:
            lengths.append(run)
            run = 0
    if run:
        lengths.append(run)
    return lengths


# ---- runners ---------------------------------------------------------------------------------------------------------
class DFlashRunner:
    """This project's loop (dflash.load) on the torch or MLX backend; the drafter-less pipeline is the baseline."""

    def __init__(self, cfg: dict, method: Method):
        if method.backend == "torch":
            import torch

            torch.set_num_threads(cfg["threads"])
        self.method, self.cfg = method, cfg
        draft = cfg["draft"] if method.block_size is not None else None
        self.pipe = api.load(cfg["target"], draft, backend=method.backend, no_draft=draft is None,
                                dtype=cfg["dtype"], device=cfg["device"], block_size=method.block_size,
                                verify=method.verify, tree_budget=cfg.get("tree_budget"),
                                copy_branch=method.copy_branch, compile=method.compile)
        self.pipe.eos_token_ids = set(cfg["eos_token_ids"])
        self.info = {"block_size": self.pipe.engine.block_size}

    def generate(self, ids: list[int], seed: int) -> dict:
        self.pipe.engine.reset()  # no prompt-prefix reuse across prompts: every method prefills from scratch
        sampling = SamplingParams(temperature=self.cfg["temperature"], seed=seed,
                                  accept=self.cfg.get("accept", "auto"),
                                  draft_temperature=self.cfg.get("draft_temperature", 0.5))
        t0 = time.perf_counter()
        r = self.pipe.generate(ids, max_new_tokens=self.cfg["max_new_tokens"], sampling=sampling)
        return self._record(r, time.perf_counter() - t0)

    def _record(self, r, seconds: float) -> dict:
        return {"tokens": r.tokens, "seconds": seconds, "prefill_seconds": r.prefill_seconds,
                "decode_seconds": r.decode_seconds, "decode_tokens": max(len(r.tokens) - 1, 0),
                "acceptance_lengths": r.acceptance_lengths if self.method.speculative else None,
                "verified": r.verified if self.method.speculative else None,
                "cycles_without_draft": r.cycles_without_draft}

    def generate_batch(self, prompts: list[list[int]], seed: int) -> list[dict]:
        """One batch through batched speculative decoding (torch). Each row is charged the batch's wall time in
        proportion to its tokens, so per-token times and throughput are the batch's."""
        sampling = SamplingParams(temperature=self.cfg["temperature"], seed=seed,
                                  accept=self.cfg.get("accept", "auto"),
                                  draft_temperature=self.cfg.get("draft_temperature", 0.5))
        t0 = time.perf_counter()
        results = self.pipe.generate_batch(prompts, max_new_tokens=self.cfg["max_new_tokens"], sampling=sampling)
        wall = time.perf_counter() - t0
        total = sum(len(r.tokens) for r in results) or 1
        return [dict(self._record(r, wall * len(r.tokens) / total), batch_seconds=wall) for r in results]


class _TimingStreamer:
    """transformers streamer: the first put() is the prompt; every later put() is one step's (or one verified
    cycle's) new tokens, timestamped."""

    def __init__(self):
        self.chunks: list[int] = []
        self.first_token_at: float | None = None
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.chunks.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFRunner:
    """transformers generate(): plain greedy/sampling, prompt lookup decoding, or assisted generation."""

    def __init__(self, cfg: dict, method: Method):
        import torch
        from transformers import AutoModelForCausalLM

        from dflash.backends.torch import quiet_loading, resolve_device, resolve_dtype

        torch.set_num_threads(cfg["threads"])
        self.torch, self.method, self.cfg = torch, method, cfg
        self.device = resolve_device(cfg["device"])
        dtype = resolve_dtype(cfg["dtype"], self.device)

        def load(path):
            with quiet_loading():
                m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
            m = m.to(self.device).eval().requires_grad_(False)
            if cfg["ignore_eos"]:
                m.generation_config.eos_token_id = None
            return m

        self.model = load(cfg["target"])
        self.assistant = load(cfg["ar_draft"]) if method.ar_draft else None
        self.kwargs: dict = {"max_new_tokens": cfg["max_new_tokens"], "min_new_tokens": 0,
                             "pad_token_id": cfg.get("pad_token_id")}
        if not cfg["ignore_eos"]:
            self.kwargs["eos_token_id"] = list(cfg["eos_token_ids"])
        if cfg["temperature"] > 0:
            self.kwargs.update(do_sample=True, temperature=cfg["temperature"], top_k=0, top_p=1.0)
        else:
            self.kwargs["do_sample"] = False
        if method.lookup:
            self.kwargs["prompt_lookup_num_tokens"] = cfg["lookup_tokens"]
        if self.assistant is not None:
            self.kwargs["assistant_model"] = self.assistant
        gc = (self.assistant or self.model).generation_config
        self.info = {"dtype": str(dtype), "device": self.device}
        if method.lookup:
            self.info.update(prompt_lookup_num_tokens=cfg["lookup_tokens"],
                             max_matching_ngram_size=gc.max_matching_ngram_size or 2)
        if self.assistant is not None:
            self.info.update({k: getattr(gc, k, None) for k in (
                "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")})
            self.info["draft_params"] = sum(p.numel() for p in self.assistant.parameters())

    def generate(self, ids: list[int], seed: int) -> dict:
        torch = self.torch
        torch.manual_seed(seed)
        streamer = _TimingStreamer()
        x = torch.tensor([ids], device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), streamer=streamer, **self.kwargs)
        wall = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        first = streamer.first_token_at or (t0 + wall)
        return {"tokens": tokens, "seconds": wall, "prefill_seconds": first - t0, "decode_seconds": t0 + wall - first,
                "decode_tokens": sum(streamer.chunks[1:]),
                "acceptance_lengths": streamer.chunks if self.method.speculative else None}


class MLXLMRunner:
    """mlx-lm stream_generate(): plain, or speculative decoding with the autoregressive draft."""

    def __init__(self, cfg: dict, method: Method):
        import mlx.core as mx
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from dflash.backends.mlx import load_target, resolve_device, resolve_dtype

        self.mx, self.method, self.cfg = mx, method, cfg
        device = resolve_device(cfg["device"] if cfg["device"] in ("cpu", "gpu") else "auto")
        mx.set_default_device(device)
        dtype = resolve_dtype(cfg["dtype"], device)
        self.model, _ = load_target(cfg["target"], dtype)
        self.draft = load_target(cfg["ar_draft"], dtype)[0] if method.ar_draft else None
        self.tokenizer = TokenizerWrapper(load_tokenizer(cfg["target"]), eos_token_ids=cfg["eos_token_ids"])
        self.tokenizer.eos_token_ids = cfg["eos_token_ids"]  # exactly the others' stop set (or none)
        self.info = {"dtype": str(dtype), "device": str(device)}
        if self.draft is not None:
            self.info["num_draft_tokens"] = cfg["mlx_draft_tokens"]

    def generate(self, ids: list[int], seed: int) -> dict:
        from mlx_lm.generate import stream_generate
        from mlx_lm.sample_utils import make_sampler

        mx = self.mx
        mx.random.seed(seed)
        kwargs: dict[str, Any] = {"sampler": make_sampler(temp=self.cfg["temperature"])}
        if self.draft is not None:
            kwargs.update(draft_model=self.draft, num_draft_tokens=self.cfg["mlx_draft_tokens"])
        tokens, flags, first = [], [], None
        t0 = time.perf_counter()
        for resp in stream_generate(self.model, self.tokenizer, mx.array(ids), max_tokens=self.cfg["max_new_tokens"],
                                    **kwargs):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(resp.token))
            flags.append(bool(resp.from_draft))
        wall = time.perf_counter() - t0
        first = first or (t0 + wall)
        first_cycle = flags.index(False) + 1 if False in flags else len(flags)  # yielded together, at `first`
        return {"tokens": tokens, "seconds": wall, "prefill_seconds": first - t0, "decode_seconds": t0 + wall - first,
                "decode_tokens": len(tokens) - first_cycle,
                "acceptance_lengths": cycles_from_draft_flags(flags) if self.method.speculative else None}


RUNNERS = {"dflash": DFlashRunner, "hf": HFRunner, "mlx_lm": MLXLMRunner}


def make_runner(cfg: dict):
    method = METHODS[cfg["method"]]
    if method.ar_draft and not cfg.get("ar_draft"):
        raise DFlashError(f"--ar-draft: method {method.name} needs an autoregressive draft model")
    return RUNNERS[method.family](cfg, method)


# ---- memory ----------------------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def accelerator_peak_bytes(runner) -> dict:
    out = {}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    if "mlx.core" in sys.modules:
        try:
            out["mlx_peak_bytes"] = int(sys.modules["mlx.core"].get_peak_memory())
        except Exception:  # noqa: BLE001 - not every MLX device reports it
            pass
    return out


# ---- worker process --------------------------------------------------------------------------------------------------
def worker(stdin=None, stdout=None) -> int:
    """Protocol, one JSON object per line. In: the config, then {"i", "prompt_ids", "seed"} per prompt (or
    {"batch": [those]} with --batch-size > 1, answered by {"records": [...]}), then {"cmd": "exit"}. Out:
    {"ready", "load_seconds", "load_rss_bytes", "info"} (or {"error"}), one record per prompt (or {"i", "error"}),
    then {"done", "peak_rss_bytes", ...}."""
    if stdout is None:
        stdout = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # anything a library prints goes to the log, not into the protocol
    stdin = stdin or sys.stdin

    def send(obj):
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()

    cfg = json.loads(stdin.readline())
    t0 = time.perf_counter()
    try:
        runner = make_runner(cfg)
        load_seconds = time.perf_counter() - t0
        load_rss = peak_rss_bytes()
        batch = cfg.get("batch_size", 1)
        for w in range(cfg.get("warmup", 1)):
            if cfg.get("warmup_ids") and batch > 1:
                runner.generate_batch([cfg["warmup_ids"]] * batch, seed=cfg.get("seed", 0) + 10_000 + w)
            elif cfg.get("warmup_ids"):
                runner.generate(cfg["warmup_ids"], seed=cfg.get("seed", 0) + 10_000 + w)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        send({"error": one_line(e)})
        return 1
    send({"ready": True, "load_seconds": load_seconds, "load_rss_bytes": load_rss, "info": runner.info})
    for line in stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("cmd") == "exit":
            break
        if "batch" in msg:  # {"batch": [{"i", "prompt_ids", "seed"}, ...]} -> {"records": [...]}
            rows = msg["batch"]
            try:
                recs = runner.generate_batch([r["prompt_ids"] for r in rows], seed=rows[0]["seed"])
            except Exception as e:  # noqa: BLE001
                recs = [{"error": one_line(e)} for _ in rows]
            send({"records": [dict(rec, i=r["i"]) for rec, r in zip(recs, rows)]})
            continue
        try:
            rec = runner.generate(msg["prompt_ids"], seed=msg["seed"])
        except Exception as e:  # noqa: BLE001
            rec = {"error": one_line(e)}
        rec["i"] = msg["i"]
        send(rec)
    send({"done": True, "peak_rss_bytes": peak_rss_bytes(), **accelerator_peak_bytes(runner)})
    return 0

