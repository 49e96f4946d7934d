"""python -m dflash.bench cost-model: what one speculative cycle costs next to one autoregressive step.

    speedup(B) = tau(B) * T_step / (T_draft(B) + T_verify(B))

Times come from the real backend methods (draft / verify / commit), at a given model shape with random weights,
so no download is needed: a bundled shape (qwen3-8b, qwen3-4b, smollm2), a hub or local config.json with an N-layer
drafter on a GPU, or the tiny default on a CPU. With a per-position acceptance curve (from `dflash.bench` or `/stats`) it also names the block
size that maximises the speedup.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import backends, cli, hub
from ..core.extras.deps import require
from ..core.errors import DFlashError
from ..core.io import atomic_write_text
from ..core.spec import DraftSpec, default_target_layer_ids
from ..core.tree import TreeInputs, chain_tree
from ..reference import tiny

TINY = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=768, vocab_size=4096)


def expected_tau(per_position: list[float], block_size: int) -> float:
    """tau(B) = 1 + sum_{k < B} P(the k-th proposal is accepted), from a per-position acceptance curve."""
    return 1.0 + sum(per_position[: block_size - 1])


def _timeit(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def measure(make_backend, block_sizes, context: int, iters: int, warmup: int, vocab: int) -> dict:
    """Median seconds of an autoregressive step and of draft / verify at each block size, at `context` tokens."""
    prompt = [random.Random(0).randrange(vocab) for _ in range(context)]

    def setup(block_size):
        be = make_backend(block_size)
        be.prefill([prompt])
        return be

    ar = setup(None)
    state = {"anchor": 1}

    def step(be):
        be.commit(be.verify(be.draft([state["anchor"]])), [1])
        be.crop(context)  # keep the context length fixed

    t_step = _timeit(lambda: step(ar), iters, warmup)
    out: dict[str, Any] = {"context": context, "t_step": t_step, "blocks": {}}
    for b in block_sizes:
        be = setup(b)
        t_cycle = _timeit(lambda: step(be), iters, warmup)
        draft = be.draft([1])

        def verify_only():
            be.commit(be.verify(draft), [1])
            be.crop(context)

        t_verify = _timeit(verify_only, iters, warmup)
        out["blocks"][b] = {"t_cycle": t_cycle, "t_verify": t_verify, "t_draft": max(t_cycle - t_verify, 0.0),
                            "cycle_over_step": t_cycle / t_step}
    return out


def drafter_spec(spec: DraftSpec, arch: str) -> DraftSpec:
    """The DFlash spec, or its DFlash2 form at the public checkpoints' selector shape."""
    if arch == "dflash2":
        return tiny.dflash2_spec(spec, selector_rank=min(256, spec.hidden_size), selector_top_k=16,
                                 conv_group_size=16)
    return spec


def torch_factory(target_config, draft_layers: int, dtype: str, device: str, cache_len: int | None = None,
                  compile: bool = False, arch: str = "dflash"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.backends.torch import GROUPED_SDPA, DFlashDrafter, torch_engine, resolve_device, resolve_dtype

    device = resolve_device(device)
    dt = resolve_dtype(dtype, device)
    cfg = AutoConfig.for_model(**target_config) if isinstance(target_config, dict) else target_config

    def build_target():
        try:
            return AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation=GROUPED_SDPA).eval()
        except ValueError:  # no SDPA path for this family (gpt-oss: attention sinks)
            return AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="eager").eval()

    text = cfg.get_text_config()
    spec = DraftSpec(hidden_size=text.hidden_size, num_hidden_layers=draft_layers,
                     num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                     head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                     # MoE-only configs (Qwen3.5-MoE) have no dense MLP width: a Qwen3-like 3x hidden drafter MLP
                     intermediate_size=getattr(text, "intermediate_size", None) or 3 * text.hidden_size,
                     vocab_size=text.vocab_size,
                     num_target_layers=text.num_hidden_layers,
                     target_layer_ids=default_target_layer_ids(text.num_hidden_layers, draft_layers),
                     mask_token_id=text.vocab_size - 1, block_size=max(16, 2))
    spec = drafter_spec(spec, arch)
    with torch.device("meta"):  # shapes only: what the weights will take, before any of it is allocated
        need = weight_bytes(build_target()) + weight_bytes(DFlashDrafter(spec).to(dt))
    check_memory(need, device, f"a {text.num_hidden_layers}-layer target of hidden size {text.hidden_size} "
                               f"and a {draft_layers}-layer drafter in {str(dt).removeprefix('torch.')}")
    torch.manual_seed(0)
    with torch.device(device):
        model = build_target()
        drafter = DFlashDrafter(spec).to(dt).eval()
    built = {}

    def make(b):
        if b not in built:  # one backend per block size (compiled graphs are per shape)
            built[b] = torch_engine(model, drafter if b else None, block_size=b, cache_len=cache_len, compile=compile)
        be = built[b]
        be.reset()
        return be

    return make, text.vocab_size


def weight_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def available_memory(device: str) -> int | None:
    """Bytes free for new tensors on `device` (CUDA: the driver's count; CPU: MemAvailable, or what the cgroup
    still allows if that is less), None where it cannot be told."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    if device != "cpu":
        return None
    free = []
    try:
        meminfo = Path("/proc/meminfo").read_text()
        free.append(int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        pass
    return min(free) if free else None


def check_memory(need: int, device: str, what: str, remedy: str = "a smaller shape, --dtype bfloat16 or a GPU"):
    """Refuse, before allocating, a shape whose random weights alone would not fit (activations and caches at the
    measured context come on top: a fifth more is asked for)."""
    free = available_memory(device)
    if free is not None and need * 1.2 > free:
        raise DFlashError(f"--target-config: the weights of {what} take {need / 2**30:.1f} GiB and {device} has "
                          f"{free / 2**30:.1f} GiB free; try {remedy}")


def dir_factory(backend: str, target_config: dict, draft_layers: int, dtype: str, device: str, arch: str = "dflash"):
    """Any backend, through checkpoint directories (tiny shapes): what a user's load() would do."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.backends.torch import DFlashDrafter, save_drafter

    cfg = dict(target_config)
    family = cfg.pop("model_type", "qwen3")
    with torch.device("meta"):  # the checkpoint is written from a float32 PyTorch model, then loaded by the backend
        need = weight_bytes(AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg)))
    check_memory(need, "cpu", f"a {cfg['num_hidden_layers']}-layer target of hidden size {cfg['hidden_size']} in "
                              "float32 (written with PyTorch for the backend to load)", remedy="a smaller shape")
    root = Path(tempfile.mkdtemp(prefix="dflash-cost-"))
    tiny.build_target(root / "target", family=family, **cfg)
    torch.manual_seed(0)
    spec = drafter_spec(tiny.draft_spec_for(root / "target", num_layers=draft_layers, block_size=16), arch)
    save_drafter(DFlashDrafter(spec), root / "draft")
    mod = backends.get(backend)
    target = tiny.mlx_layout(root / "target", root / "target_mlx") if backend == "mlx" else root / "target"
    loaded = {}

    def make(b):
        key = b is not None
        if key not in loaded:
            loaded[key] = mod.load(target, root / "draft" if key else None, dtype=dtype, device=device)
        be = loaded[key]
        if b:
            be.block_size = b
        be.reset()
        return be

    return make, cfg["vocab_size"]


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench cost-model", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-config", "--model", dest="target_config", help="the target's shape: a bundled one "
                   "(qwen3-8b, qwen3-4b, smollm2), a config.json path, a model directory or a hub id (default: "
                   "tiny 8x256)")
    p.add_argument("--draft-layers", type=int, default=3)
    p.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                   help="drafter architecture (dflash2: convolutions + the candidate selector)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="torch")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", action="store_true", help="torch: StaticCache + torch.compile (CUDA graphs on GPU)")
    p.add_argument("--tau", type=float, nargs="*", default=[], help="tau values to print the implied speedup for")
    p.add_argument("--acceptance", help="JSON list of per-position acceptance rates (or a bench JSON with one)")
    p.add_argument("--tree-budgets", type=int, nargs="*", default=[],
                   help="draft nodes per tree verify to measure (the tree forward of --verify tree / auto)")
    p.add_argument("--tree-curve", help="a `python -m dflash.bench tree-curve` JSON: tau per budget, for the "
                   "predicted speedup of each budget on this device")
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    # both backends' random-weight models are built with transformers' PyTorch classes
    require("torch", "python -m dflash.bench cost-model")

    name = backends.pick(args.backend)
    if any(b < 2 or b > 64 for b in args.block_sizes):
        raise DFlashError(f"--block-sizes: got {args.block_sizes}, expected values in 2..64")
    if args.target_config:
        cfg = load_config(args.target_config)
    else:
        cfg = dict(TINY, model_type="qwen3")
    if name == "torch":
        from transformers import AutoConfig

        conf = AutoConfig.for_model(**cfg) if isinstance(cfg, dict) else cfg
        cache_len = args.context + 4 * max(args.block_sizes) + 8 if args.compile else None
        make, vocab = torch_factory(conf, args.draft_layers, args.dtype, args.device, cache_len, args.compile,
                                    args.arch)
    else:
        if not isinstance(cfg, dict):
            cfg = {k: v for k, v in cfg.to_dict().items() if k in TINY or k == "model_type"}
        make, vocab = dir_factory(name, cfg, args.draft_layers, args.dtype, args.device, args.arch)
    res = measure(make, args.block_sizes, args.context, args.iters, args.warmup, vocab)
    res.update(backend=name, draft_layers=args.draft_layers, arch=args.arch,
               target=args.target_config or "tiny (8 layers, hidden 256)")
    print(f"{name}: T_step {res['t_step'] * 1e3:.2f} ms at context {args.context}")
    print(f"{'block':>5} {'T_draft ms':>10} {'T_verify ms':>11} {'cycle/step':>10}" +
          "".join(f"  x@tau={t:g}" for t in args.tau))
    for b, r in res["blocks"].items():
        line = f"{b:>5} {r['t_draft'] * 1e3:>10.2f} {r['t_verify'] * 1e3:>11.2f} {r['cycle_over_step']:>10.2f}"
        line += "".join(f"  {t / r['cycle_over_step']:>8.2f}" for t in args.tau)
        print(line)
    if args.acceptance:
        curve = load_curve(args.acceptance)
        best = max(res["blocks"], key=lambda b: expected_tau(curve, b) / res["blocks"][b]["cycle_over_step"])
        for b, r in res["blocks"].items():
            r["expected_tau"] = expected_tau(curve, b)
            r["speedup"] = r["expected_tau"] / r["cycle_over_step"]
        res["best_block_size"] = best
        print(f"best block size for this acceptance curve: {best} "
              f"(tau {res['blocks'][best]['expected_tau']:.2f}, speedup {res['blocks'][best]['speedup']:.2f}x)")
    if args.tree_budgets:
        backend = make(max(args.block_sizes))
        backend.prefill([[random.Random(0).randrange(vocab) for _ in range(args.context)]])
        res["trees"] = tree_budgets(backend, args.tree_budgets, res["t_step"],
                                    res["blocks"][max(args.block_sizes)]["t_draft"],
                                    load_tree_curve(args.tree_curve) if args.tree_curve else {})
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=2))
    return 0


def tree_budgets(backend, budgets: list[int], t_step: float, t_draft: float, curve: dict[int, float]) -> dict:
    """T_verify(n + 1) of the tree forward for each budget n, the cycle's cost in target steps, and with a measured
    tau per budget the predicted speedup tau(n) * T_step / (T_draft + T_verify(n + 1))."""
    rows: dict[int, dict] = {}
    verify_seconds: list[tuple[int, float]] = []  # (tokens, seconds)
    print(f"{'nodes':>5} {'T_verify ms':>11} {'cycle/step':>10}" + ("  tau   speedup" if curve else ""))
    for n in sorted(budgets):  # (increasing, so that the curve is made monotone as it is measured)
        # (monotone in tokens, as every measured curve here: more tokens never cost less, whatever a timing's noise)
        verify = max([tree_verify_seconds(backend, n + 1)] + [t for _, t in verify_seconds])
        verify_seconds.append((n + 1, verify))
        row = {"t_verify": verify, "cycle_over_step": (t_draft + verify) / t_step}
        line = f"{n:>5} {verify * 1e3:>11.2f} {row['cycle_over_step']:>10.2f}"
        if n in curve:
            row.update(tau=curve[n], speedup=curve[n] / row["cycle_over_step"])
            line += f"  {curve[n]:.2f}  {row['speedup']:.2f}x"
        rows[n] = row
        print(line)
    best = [n for n in rows if "speedup" in rows[n]]
    if best:
        n = max(best, key=lambda k: rows[k]["speedup"])
        print(f"best tree budget for this curve on this device: {n} nodes ({rows[n]['speedup']:.2f}x)")
    return {"budgets": rows, "verify_seconds": verify_seconds,
            "best_budget": max(best, key=lambda k: rows[k]["speedup"]) if best else None}


def tree_verify_seconds(backend, tokens: int, iters: int = 9, warmup: int = 2) -> float:
    """Median seconds of one target forward of a chain-shaped tree of `tokens` tokens (the tree path's own mask and
    positions) after the backend's cached prompt, its sampling and host read included; the cache is rewound after
    each."""
    target = backend.target
    anchor = backend.tokens[-1]
    inputs = TreeInputs.of([chain_tree(anchor, [anchor] * (tokens - 1))])
    ids = target.ids(inputs.ids.tolist())

    def forward():
        logits, _ = target.forward(ids, last_only=False, tree=inputs)
        target.to_host(target.sample(logits, backend.rows, ids, backend.row_sampling))
        target.keep([0], tokens)

    return _timeit(forward, iters, warmup)


def load_tree_curve(path: str) -> dict[int, float]:
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        return {int(r["budget"]): float(r["tau"]) for r in rows if r["kind"] == "tree"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"--tree-curve: {path} is not a `dflash.bench tree-curve` JSON ({e})") from None


def load_config(name: str):
    """A config.json path, a bundled shape (qwen3-8b, qwen3-4b, smollm2), or a hub id / model directory."""
    from transformers import AutoConfig

    bundled = Path(__file__).parent / "configs" / f"{name.lower()}.json"
    path = bundled if bundled.is_file() else Path(name)
    try:
        if path.is_file():
            return AutoConfig.for_model(**json.loads(path.read_text()))
        return AutoConfig.from_pretrained(str(hub.resolve(name, "--target-config")))
    except (ValueError, TypeError, KeyError) as e:  # JSON, an unknown model_type, transformers' field validation
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
        raise DFlashError(f"--target-config: {name} is not a usable model config ({first})") from None


def load_curve(path: str) -> list[float]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DFlashError(f"--acceptance: cannot read {path} ({e})") from None
    if isinstance(data, dict):
        data = data.get("per_position_acceptance")
    if not isinstance(data, list) or not all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in data):
        raise DFlashError(f"--acceptance: {path} must hold a list of rates in [0, 1]")
    return [float(x) for x in data]


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
