"""Train a DFlash drafter: one readable loop, from one CPU process to many GPUs under torchrun.

    result = train(TrainConfig(target="Qwen/Qwen3-8B", data="answers.jsonl", out="runs/q8"))

The step, top to bottom:
  1. the global batch of step s is a fixed slice of a seeded per-epoch permutation; rank r takes its share of it
  2. anchors of every sample come from a generator seeded by (seed, epoch, sample index): fresh every epoch, and the
     same whichever rank / micro-batch / restart computes them
  3. the loss is sum(w * CE) over the WHOLE global batch / sum(w) over the whole global batch (one all_reduce of
     the weight sum before the forward): the curve does not depend on world size or gradient accumulation
  4. target features online (frozen target forward) or from a feature cache; one packed drafter forward per
     micro-batch; AdamW, clip, cosine LR
Checkpoints are complete (weights, optimiser, step, every rank's RNG) and atomic, so SIGKILL + rerun continues
bit-for-bit. Evaluation runs the real speculative loop on held-out prompts and reports tau, not token accuracy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pickle
import random
import shutil
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dflash.errors import DFlashError
from dflash.spec import DraftSpec, default_target_layer_ids

from .drafter import DFlashDrafter, load_drafter, save_drafter
from .training import attention_fn, block_loss_sum, cosine_lr, default_gamma, sample_anchors


@dataclass
class TrainConfig:
    # what to train on
    target: str = ""  # target model directory (or hub id)
    data: str | None = None  # JSONL / datasets dir of chat or tokenised rows
    features: str | None = None  # a cache-features directory (samples + offline features); replaces --data
    out: str = "runs/dflash"
    samples: list | None = field(default=None, repr=False)  # in-process: [{"input_ids", "loss_mask"}]
    enable_thinking: bool | None = None
    max_length: int = 3072
    # drafter
    init_from: str | None = None  # an existing drafter directory; otherwise a new one shaped from the target
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    init_layers: str = "target"  # "target": copy the target's last decoder layers where shapes match; "random"
    # objective
    num_anchors: int = 512
    gamma: float | None = None
    # optimisation
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    epochs: float = 6.0
    max_steps: int | None = None
    batch_size: int = 1  # sequences per micro-batch per rank
    grad_accum: int = 1  # micro-batches per step; global batch = batch_size * grad_accum * world size
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere; bfloat16: autocast on any device
    activation_checkpointing: bool = False
    parallel: str = "ddp"  # ddp | fsdp (only used with more than one process)
    device: str = "auto"
    trust_remote_code: bool = False
    # checkpoints
    save_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = True
    # evaluation: real acceptance length of the speculative loop on held-out prompts
    eval_every: int = 0
    eval_data: str | None = None
    eval_prompts: list | None = field(default=None, repr=False)  # in-process: lists of prompt ids
    eval_holdout: int = 0  # hold out this many training samples and evaluate on their prompts
    eval_max_prompts: int = 8
    eval_max_new_tokens: int = 128
    # output
    log_every: int = 1
    progress: bool = True
    plot: bool = True
    push_to_hub: str | None = None
    quiet: bool = False

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("samples"), d.pop("eval_prompts")
        return d


@dataclass
class TrainResult:
    draft_dir: Path
    steps: int
    losses: list[float]
    evals: list[dict]
    seconds: float

    @property
    def tau(self) -> float | None:
        return self.evals[-1]["tau"] if self.evals else None


# ---- distributed -----------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            x = x.clone()
            dist.all_reduce(x)
        return x


def init_distributed(device: str) -> Dist:
    """env:// initialisation (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, also across nodes)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend, init_method="env://")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


# ---- data --------------------------------------------------------------------------------------------------------------
def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # one stream per (seed, epoch, sample): reproducible on any rank, after any restart, fresh every epoch
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_000_007 + index)


@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def step_indices(step: int, n: int, global_batch: int, seed: int) -> tuple[int, list[int]]:
    """(epoch, sample indices) of the global batch of `step`; the last partial batch of an epoch is dropped."""
    per_epoch = n // global_batch
    epoch, i = divmod(step, per_epoch)
    return epoch, epoch_order(n, seed, epoch)[i * global_batch:(i + 1) * global_batch]


def collate(samples: list[dict], anchors: list, device) -> tuple:
    """Right-pad a micro-batch; anchors are trimmed to the most valid ones any sample has (pads are masked)."""
    s = max(len(x["input_ids"]) for x in samples)
    ids = torch.zeros(len(samples), s, dtype=torch.long)
    mask = torch.zeros(len(samples), s, dtype=torch.bool)
    for i, x in enumerate(samples):
        ids[i, :len(x["input_ids"])] = torch.as_tensor(x["input_ids"], dtype=torch.long)
        mask[i, :len(x["loss_mask"])] = torch.as_tensor(x["loss_mask"], dtype=torch.bool)
    n = max(1, max(int(v.sum()) for _, v in anchors))
    a = torch.stack([a[:n] for a, _ in anchors])
    v = torch.stack([v[:n] for _, v in anchors])
    return ids.to(device), mask.to(device), a.to(device), v.to(device)


def sample_weight(sample: dict, anchors, valid, block_size: int, gamma: float) -> float:
    """sum of loss weights of one sample's blocks (for the global normaliser), without building the blocks."""
    mask = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)
    s = mask.shape[0]
    k = torch.arange(1, block_size)
    pos = anchors[valid][:, None] + k
    ok = (pos < s) & mask[pos.clamp(max=s - 1)]
    return float((torch.exp(-(k.float() - 1) / gamma) * ok).sum())


# ---- model ------------------------------------------------------------------------------------------------------------
class PackedDrafter(nn.Module):
    """The drafter's packed training forward as one module call, so DDP / FSDP hooks see the whole step."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, x, features, positions, mask):
        d = self.drafter
        s = features.shape[1]
        ctx = d.project_context(features)
        ctx_pos = torch.arange(s, device=features.device).expand(features.shape[0], s)
        rope_q = d.rope(positions, x)
        rope_kv = d.rope(torch.cat([ctx_pos, positions], 1), x)
        return d(x, ctx, rope_q, rope_kv, attention_fn(mask))


def first_free_embedding_row(tokenizer, vocab_rows: int) -> int | None:
    n = len(tokenizer) if tokenizer is not None else None
    return n if n is not None and n < vocab_rows else None


def new_draft_spec(cfg: TrainConfig, target_model, tokenizer) -> DraftSpec:
    from .target import target_info

    info = target_info(target_model)
    tcfg = target_model.config.get_text_config()
    n_target = info.num_hidden_layers
    mask_id = cfg.mask_token_id
    if mask_id is None:
        mask_id = first_free_embedding_row(tokenizer, info.vocab_size)
        if mask_id is None:
            raise DFlashError(f"--mask-token-id: the target's embedding table has {info.vocab_size} rows and no unused "
                              "row past the tokenizer's vocabulary; pass --mask-token-id ID explicitly")
    if not 0 <= mask_id < info.vocab_size:
        raise DFlashError(f"--mask-token-id: {mask_id} is outside the target's embedding table "
                          f"(0..{info.vocab_size - 1})")
    layer_ids = cfg.target_layer_ids or default_target_layer_ids(n_target, cfg.num_layers)
    rope = getattr(tcfg, "rope_parameters", None) or {}
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != \
        "default" else None
    heads = tcfg.num_attention_heads
    spec = DraftSpec(
        hidden_size=tcfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        intermediate_size=tcfg.intermediate_size, vocab_size=info.vocab_size, num_target_layers=n_target,
        target_layer_ids=list(layer_ids), mask_token_id=int(mask_id), block_size=cfg.block_size,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6), rope_theta=float(info.rope_theta or 10000.0),
        rope_scaling=rope_scaling, max_position_embeddings=getattr(tcfg, "max_position_embeddings", 40960),
        attention_bias=bool(getattr(tcfg, "attention_bias", False)))
    spec.check("--num-layers/--block-size/--target-layer-ids")
    spec.validate_against(info, source="new drafter")
    return spec


def init_drafter(spec: DraftSpec, target_model, mode: str, seed: int) -> DFlashDrafter:
    """A new drafter. Linear weights ~ N(0, target initializer_range) (the HF Qwen3 init), norms = 1. With mode
    "target", draft layer i starts as a copy of target layer L-n+i wherever names and shapes match, and the final
    norm as the target's: the last target layers already map hidden states into the space the shared LM head reads,
    which makes the first steps productive instead of spent aligning random layers to the LM head."""
    from .target import decoder_layers

    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    std = getattr(target_model.config.get_text_config(), "initializer_range", 0.02)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    if mode == "target":
        layers = decoder_layers(target_model)
        offset = len(layers) - spec.num_hidden_layers
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                src = layers[max(offset + i, 0)].state_dict()
                for name, p in layer.state_dict().items():
                    if name in src and src[name].shape == p.shape:
                        p.copy_(src[name])
            base = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
            if hasattr(base, "norm") and base.norm.weight.shape == model.norm.weight.shape:
                model.norm.weight.copy_(base.norm.weight)
    elif mode != "random":
        raise DFlashError(f"--init-layers: got {mode!r}, expected target or random")
    return model


# ---- checkpoints ---------------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    # tensors and lists only, so resume can use torch.load(weights_only=True)
    py = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [py[0], list(py[1]), py[2]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _model_state(module, drafter, fsdp: bool) -> dict:
    """The drafter's full weights with canonical names (collective under FSDP: every rank must call it)."""
    if not fsdp:
        return drafter.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("drafter."): v for k, v in sd.items()}


def _state_dicts(module, optimizer, fsdp: bool):
    """Full (unsharded, unwrapped) model and optimiser state; keys as in PackedDrafter ("drafter.layers.0...")."""
    if not fsdp:
        return getattr(module, "module", module).state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=opts), get_optimizer_state_dict(module, optimizer, options=opts)


def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / "DONE").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(out: Path, step: int, module, optimizer, fsdp: bool, d: Dist, keep: int) -> None:
    """Complete and atomic: every rank writes its RNG state into a temporary directory, rank 0 writes the weights,
    optimiser and trainer state, then renames the directory into place (a multi-node run needs a shared `out`)."""
    root = out / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    model_sd, optim_sd = _state_dicts(module, optimizer, fsdp)  # collective under FSDP
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    torch.save(rng_state(), tmp / f"rng_rank{d.rank}.pt")
    d.barrier()
    if d.main:
        torch.save(model_sd, tmp / "model.pt")
        torch.save(optim_sd, tmp / "optimizer.pt")
        torch.save({"step": step, "world": d.world}, tmp / "trainer.pt")
        for f in tmp.iterdir():  # durable before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        (tmp / "DONE").write_text("ok\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    d.barrier()


def _load_weights_only(path: Path):
    """torch.load restricted to tensors and plain containers: a checkpoint that pickles anything else (code to run on
    load) is refused with one line, never executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((x.strip().rstrip(".") for x in str(e).splitlines() if "GLOBAL" in x), None)
        raise DFlashError(f"{path}: not a weights-only checkpoint, refusing to unpickle it (" +
                          (what or "corrupted, or it holds objects other than tensors") + ")") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"{path}: cannot read the checkpoint ({first}); delete {path.parent} to start over "
                          "or pass --resume false") from None


def load_checkpoint(path: Path, module, optimizer, fsdp: bool, d: Dist) -> int:
    load = lambda name: _load_weights_only(path / name)
    model_sd, optim_sd, state = load("model.pt"), load("optimizer.pt"), load("trainer.pt")
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, model_sd, options=opts)
        set_optimizer_state_dict(module, optimizer, optim_sd, options=opts)
    else:
        getattr(module, "module", module).load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
    rng = path / f"rng_rank{d.rank}.pt"
    if rng.is_file():  # a run resumed on a different world size keeps fresh RNG on the new ranks
        set_rng_state(_load_weights_only(rng))
    return int(state["step"])


# ---- evaluation -------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(target_model, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
             eos_token_ids=()) -> dict:
    """Real acceptance: run the speculative loop (greedy) on each prompt and pool the acceptance lengths."""
    from dflash.loop import generate
    from dflash.stats import acceptance_histogram, mean_acceptance_length, per_position_acceptance

    from .backend import TorchBackend

    dtype = target_model.get_input_embeddings().weight.dtype
    was_training = drafter.training
    backend = TorchBackend(target_model, drafter.to(dtype).eval())
    lengths = []
    try:
        for p in prompts:
            backend.reset()
            lengths += generate(backend, p, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)\
                .acceptance_lengths
    finally:
        backend.close()
        drafter.train(was_training)
    b = drafter.spec.block_size
    return {"tau": mean_acceptance_length(lengths), "cycles": len(lengths),
            "per_position": per_position_acceptance(lengths, b), "histogram": acceptance_histogram(lengths, b)}


# ---- the run ---------------------------------------------------------------------------------------------------------
def _log(cfg: TrainConfig, d: Dist, msg: str) -> None:
    if d.main and not cfg.quiet:
        print(msg, flush=True)


def train(cfg: TrainConfig) -> TrainResult:
    from dflash import hub
    from dflash.tokenizer import eos_token_ids, load_tokenizer

    from .target import load_target, resolve_device, resolve_dtype

    t_start = time.perf_counter()
    device = resolve_device(cfg.device)
    d = init_distributed(device)
    if device == "cuda":
        device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(device)
    out = Path(cfg.out)
    if d.main:
        from dflash.io import check_output_dir

        check_output_dir(out, "--out")  # created only once the inputs are validated: a refused run leaves nothing

    # --- target (frozen), tokenizer, data -------------------------------------------------------------------------
    if not cfg.target:
        raise DFlashError("--model: the target model is required")
    target_dir = hub.resolve(cfg.target, "--model")
    target_dtype = resolve_dtype("auto" if cfg.dtype == "auto" else cfg.dtype, device)
    target = load_target(target_dir, target_dtype, device, trust_remote_code=cfg.trust_remote_code)
    tokenizer = None
    with contextlib.suppress(DFlashError):
        tokenizer = load_tokenizer(target_dir, cfg.trust_remote_code)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    cache = None
    if cfg.samples is not None:
        samples = [dict(x) for x in cfg.samples]
    elif cfg.features:
        from .features import FeatureCache

        cache = FeatureCache(cfg.features, device=device)
        samples = cache.samples()
    elif cfg.data:
        from dflash.datasets import load_samples

        samples = load_samples(cfg.data, tokenizer, max_length=cfg.max_length, enable_thinking=cfg.enable_thinking)
    else:
        raise DFlashError("--data: training data is required (JSONL / datasets dir, or --features DIR)")
    # compact storage (4 + 1 bytes per token instead of Python lists): 800K x 3K-token samples fit in memory
    samples = [dict(x, input_ids=array("i", x["input_ids"][:cfg.max_length]),
                    loss_mask=array("b", x["loss_mask"][:cfg.max_length])) for x in samples]
    eval_prompts = [list(p) for p in cfg.eval_prompts] if cfg.eval_prompts else []
    if cfg.eval_holdout:
        from dflash.datasets import prompt_of

        held, samples = samples[-cfg.eval_holdout:], samples[:-cfg.eval_holdout]
        eval_prompts += [prompt_of(x) for x in held]
    if cfg.eval_data:
        from dflash.datasets import load_eval_prompts

        eval_prompts += load_eval_prompts(cfg.eval_data, tokenizer, cfg.enable_thinking)
    eval_prompts = [p for p in eval_prompts if p][:cfg.eval_max_prompts]

    global_batch = cfg.batch_size * cfg.grad_accum * d.world
    if len(samples) < global_batch:
        raise DFlashError(f"--batch-size: global batch {global_batch} (batch x grad-accum x world) is larger than "
                          f"the {len(samples)} training samples")
    steps_per_epoch = len(samples) // global_batch
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    # --- drafter ---------------------------------------------------------------------------------------------------
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from, dtype=torch.float32, device="cpu")
        spec = drafter.spec
        from .target import target_info

        spec.validate_against(target_info(target), source=str(cfg.init_from))
        drafter.train()
    else:
        spec = new_draft_spec(cfg, target, tokenizer)
        drafter = init_drafter(spec, target, cfg.init_layers, cfg.seed)
    if cache is not None and cache.target_layer_ids != spec.target_layer_ids:
        raise DFlashError(f"--features: cached layers {cache.target_layer_ids} differ from the drafter's "
                          f"target_layer_ids {spec.target_layer_ids}")
    drafter.to(device).float().requires_grad_(True)
    gamma = cfg.gamma or default_gamma(spec.block_size)
    if cfg.activation_checkpointing:
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        for layer in drafter.layers:  # instance-level forward: the state dict keeps its canonical names
            layer.forward = partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)

    module = PackedDrafter(drafter)
    fsdp = d.world > 1 and cfg.parallel == "fsdp"
    if d.world > 1 and cfg.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module, device_ids=[d.local_rank] if device.startswith("cuda") else None)
    elif fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:
            fully_shard(layer)
        fully_shard(module)
    elif d.world > 1:
        raise DFlashError(f"--parallel: got {cfg.parallel!r}, expected ddp or fsdp")
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                  weight_decay=cfg.weight_decay)

    from .features import OnlineFeatures

    features = cache if cache is not None else OnlineFeatures(target, spec.target_layer_ids)
    # bf16 autocast: the default on CUDA; on CPU when asked (--dtype bfloat16: fast on CPUs with AMX / AVX512-BF16)
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.startswith("cuda"))
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    # --- resume ------------------------------------------------------------------------------------------------------
    step = 0
    log_path = out / "train_log.jsonl"
    done = checkpoint_dirs(out) if cfg.resume else []
    if done:
        step = load_checkpoint(done[-1], module, optimizer, fsdp, d)
        _log(cfg, d, f"resumed from {done[-1]} (step {step})")
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        # the log keeps what the checkpoint covers; entries of a killed run past it are replayed
        rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()] \
            if log_path.is_file() and step > 0 else []
        rows = [r for r in rows if r.get("step", 0) <= step]
        log_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2, default=str) + "\n")
        _log(cfg, d, f"training {spec.num_hidden_layers}-layer drafter, block {spec.block_size}, "
                     f"{len(samples)} samples, {total} steps x global batch {global_batch} (world {d.world})")
    losses = [r["loss"] for r in rows if "loss" in r] if d.main else []
    evals = [r for r in rows if "tau" in r] if d.main else []
    log_file = open(log_path, "a") if d.main else None
    eos = eos_token_ids(target_dir, tokenizer) if tokenizer is not None else set()

    def run_eval(at: int):
        if not eval_prompts:
            return
        state = _model_state(module, drafter, fsdp)
        if d.main:
            probe = DFlashDrafter(spec)
            probe.load_state_dict(state)
            r = evaluate(target, probe.to(device), eval_prompts, cfg.eval_max_new_tokens, eos)
            features.capture.outputs.clear() if hasattr(features, "capture") else None
            row = {"step": at, **r}
            evals.append(row)
            log_file.write(json.dumps(row) + "\n")
            log_file.flush()
            _log(cfg, d, f"eval step {at}: tau {r['tau']:.2f} over {r['cycles']} cycles")
        d.barrier()

    bar = None
    if d.main and cfg.progress and not cfg.quiet:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="train", dynamic_ncols=True)
    if cfg.eval_every and step == 0:
        run_eval(0)  # the untrained drafter's tau: the baseline the curve starts from
    module.train()
    b, accum = cfg.batch_size, cfg.grad_accum
    while step < total:
        # 1. this rank's share of the global batch, and its anchors
        epoch, idx = step_indices(step, len(samples), global_batch, cfg.seed)
        mine = idx[d.rank * b * accum:(d.rank + 1) * b * accum]
        anchors = [sample_anchors(torch.as_tensor(samples[i]["loss_mask"], dtype=torch.bool)[None], cfg.num_anchors,
                                  anchor_generator(cfg.seed, epoch, i)) for i in mine]
        anchors = [(a[0], v[0]) for a, v in anchors]
        # 2. the global normaliser: sum of loss weights over the whole global batch
        wsum = torch.tensor(sum(sample_weight(samples[i], a, v, spec.block_size, gamma)
                                for i, (a, v) in zip(mine, anchors)), dtype=torch.float64)
        wsum = float(d.sum(wsum).clamp(min=1e-6))
        lr = cosine_lr(step, total, cfg.lr, cfg.warmup_ratio, cfg.min_lr_ratio)
        for g in optimizer.param_groups:
            g["lr"] = lr
        # 3. forward / backward per micro-batch
        stats = torch.zeros(3, dtype=torch.float64)  # loss sum, correct sum, weight sum
        for m in range(accum):
            part = slice(m * b, (m + 1) * b)
            batch = [samples[i] for i in mine[part]]
            ids, mask, a, v = collate(batch, anchors[part], device)
            feats = features(batch, ids)
            sync = m == accum - 1
            no_sync = module.no_sync() if isinstance(module, nn.parallel.DistributedDataParallel) and not sync \
                else contextlib.nullcontext()
            if fsdp:
                module.set_requires_gradient_sync(sync)
            with no_sync, autocast:
                loss_sum, correct, w = block_loss_sum(drafter, embed, lm_head, feats, ids, mask, a, v,
                                                      block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                                                      gamma=gamma, forward=module)
                # DDP / FSDP average gradients over ranks: scale by world so the result is sum / global weight
                loss = loss_sum * (d.world / wsum)
                if not loss.requires_grad:  # no supervised slot in this micro-batch: still join the reduction
                    loss = loss + sum(p.sum() * 0 for p in module.parameters())
                loss.backward()
            stats += torch.stack([loss_sum.detach().double().cpu(), correct.detach().double().cpu(),
                                  w.detach().double().cpu()])
        # 4. clip, step
        grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        stats = d.sum(stats)
        loss_v, acc_v = float(stats[0] / wsum), float(stats[1] / wsum)
        if d.main:
            losses.append(loss_v)
            if step % cfg.log_every == 0 or step == total:
                row = {"step": step, "epoch": epoch, "loss": loss_v, "accuracy": acc_v, "lr": lr,
                       "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                          else grad_norm),
                       "elapsed": time.perf_counter() - t_start}
                log_file.write(json.dumps(row) + "\n")
                log_file.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_v:.3f}", acc=f"{acc_v:.2f}", lr=f"{lr:.1e}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            run_eval(step)
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            save_checkpoint(out, step, module, optimizer, fsdp, d, cfg.keep_checkpoints)
    if bar is not None:
        bar.close()

    # --- final checkpoint, export, evaluation, plots ------------------------------------------------------------------
    if cfg.save_every and not (checkpoint_dirs(out) and checkpoint_dirs(out)[-1].name == f"step_{total:08d}"):
        save_checkpoint(out, step, module, optimizer, fsdp, d, cfg.keep_checkpoints)
    state = _model_state(module, drafter, fsdp)
    draft_dir = out / "draft"
    if d.main:
        final = DFlashDrafter(spec)
        final.load_state_dict({k: v.cpu() for k, v in state.items()})
        save_drafter(final, draft_dir)
        _log(cfg, d, f"exported drafter to {draft_dir}")
    if eval_prompts and not (evals and evals[-1]["step"] == step):
        run_eval(step)
    if d.main:
        log_file.close()
        if cfg.plot:
            plot_curves(log_path, out / "curves.png")
        if cfg.push_to_hub:
            push_to_hub(draft_dir, cfg.push_to_hub)
    if hasattr(features, "close"):
        features.close()
    d.barrier()
    return TrainResult(draft_dir=draft_dir, steps=step, losses=losses, evals=evals,
                       seconds=time.perf_counter() - t_start)


def plot_curves(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "tau" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows])
    axes[0].set(xlabel="step", ylabel="loss", title="training loss")
    axes[1].plot([r["step"] for r in eval_rows], [r["tau"] for r in eval_rows], marker="o")
    axes[1].set(xlabel="step", ylabel="tau", title="acceptance length (speculative loop, greedy)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def push_to_hub(draft_dir: Path, repo: str) -> None:
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=str(draft_dir), repo_id=repo)
    except Exception as e:  # network, auth: the local export is already done
        raise DFlashError(f"--push-to-hub {repo}: upload failed ({type(e).__name__}: {e})") from None
