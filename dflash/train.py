"""python -m dflash.train: train a DFlash drafter for a target, from one CPU process to many GPUs / nodes.

    python -m dflash.train --model Qwen/Qwen3-8B --data answers.jsonl --out runs/q8            # one process
    torchrun --nproc-per-node 8 -m dflash.train --config q8.yaml --parallel fsdp                 # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m dflash.train --config q8.yaml                                                         # two nodes

Every hyperparameter is a flag and a key of the --config file (YAML or JSON, keys spelled like the flags with
underscores); flags given explicitly override the file. Rerunning the same command resumes from the newest
checkpoint in --out. Output: OUT/draft (canonical checkpoint), OUT/train_log.jsonl, OUT/curves.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from pathlib import Path

from . import cli
from .core.errors import DFlashError
from .core.extras.plots import can_plot, pyplot, save

HELP = {
    "target": "target model: local HF directory or hub id",
    "data": "training data: JSONL (chat, ShareGPT or tokenised rows) or a datasets directory",
    "features": "offline features directory from `python -m dflash.data cache-features` (replaces --data)",
    "out": "run directory: checkpoints, log, plots, exported drafter",
    "enable_thinking": "render chats with enable_thinking (default: each row's 'thinking' field)",
    "max_length": "truncate sequences to this many tokens",
    "arch": "dflash or dflash2 (DFlash2: two-tap dynamic convolutions and a candidate selector; docs/dflash2.md). "
            "Default: dflash for a new drafter, the drafter's own with --init-from; --arch dflash2 --init-from a "
            "DFlash drafter starts from its weights (identity convolutions, a new selector)",
    "conv_kernel_size": "DFlash2: convolution taps",
    "conv_group_size": "DFlash2: channels sharing one dynamic kernel coefficient (divides the hidden size)",
    "selector_rank": "DFlash2: rank of the selector's codebooks",
    "selector_top_k": "DFlash2: candidates the selector chooses among per position",
    "selector_loss_weight": "DFlash2: weight of the selector's loss (a top-k cross-entropy, the gold token kept "
                            "among the candidates, teacher-forced predecessors) added to each slot's loss",
    "init_from": "start from an existing drafter directory instead of --init-from-target",
    "num_layers": "draft decoder layers (new drafter)",
    "block_size": "block size B trained for (new drafter)",
    "mask_token_id": "mask token id (default: first unused embedding row past the tokenizer vocabulary)",
    "target_layer_ids": "comma-separated target layer ids (default: evenly spaced from 1 to L-3)",
    "context_mode": "kv: DFlash (target features as K/V of every draft layer); ablation drafters, torch only, not "
                    "exportable to vLLM / SGLang: none (no target features), input (input fusion: the last context "
                    "feature added to the block's embeddings)",
    "draft_vocab": "give the drafter a draft vocabulary (FR-Spec; EAGLE-3's d2t/t2d, as vLLM reads them): its own LM "
                   "head over the N tokens most frequent in the training answers (the target's rows, frozen); "
                   "slots labelled with other tokens carry no loss. Default: the target's whole vocabulary",
    "init_layers": "target: copy the target's last decoder layers where shapes match; target-first: its first "
                   "layers; random: HF-style init",
    "draft_window": "train with the draft context window inference will use (generate --draft-window N): each block "
                    "sees at most the N positions before its anchor",
    "sliding_window": "new drafter: declare sliding-window layers with this window (trained as inference runs them)",
    "layer_types": "new drafter: comma-separated sliding_attention / full_attention per layer (default: all sliding "
                   "when --sliding-window is given)",
    "is_causal": "new drafter: sliding layers causal inside the block (default: the config rule, causal)",
    "num_anchors": "random anchors (blocks) per sequence per epoch",
    "gamma": "loss position decay w_k = exp(-(k-1)/gamma) (default 7/5/4 for block 16/10/8)",
    "kl_weight": "blend each slot's CE on the data token with CE against the target's full next-token distribution "
                 "(0: the paper's loss; with --features, the cache must hold the target's top-k: cache-features "
                 "--top-k)",
    "kl_top_k": "the soft label keeps the target's K most likely tokens, renormalised (0: the whole vocabulary)",
    "soft_loss": "the soft label's term: kl (cross-entropy against the target's distribution p) or lk "
                 "(-log sum min(p, q): the probability that a draft from q is accepted against p, 1 - TV)",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "cosine floor as a fraction of --lr",
    "warmup_ratio": "linear warmup as a fraction of the steps",
    "weight_decay": "AdamW weight decay",
    "betas": "AdamW betas, e.g. 0.9,0.95",
    "grad_clip": "gradient-norm clip",
    "epochs": "epochs over the data (ignored with --max-steps)",
    "max_steps": "optimizer steps (overrides --epochs)",
    "batch_size": "sequences per micro-batch per process",
    "grad_accum": "micro-batches per optimizer step (global batch = batch x accum x world)",
    "seed": "seed of the data order, anchors and initialisation",
    "dtype": "auto (bf16 autocast + bf16 target on CUDA; bf16 autocast on CPUs with AMX / AVX512-BF16; float32 "
             "elsewhere), float32 or bfloat16",
    "activation_checkpointing": "recompute draft layers in backward (less memory)",
    "parallel": "ddp or fsdp (FSDP2 fully_shard) when run under torchrun",
    "device": "auto, cpu, cuda, mps",
    "trust_remote_code": "allow model code from the target checkpoint",
    "save_every": "checkpoint every N steps (0: only when Ctrl-C or SIGTERM stops the run; the final state is always "
                  "exported)",
    "keep_checkpoints": "checkpoints to keep",
    "resume": "resume from the newest checkpoint in --out",
    "eval_every": "measure real acceptance (speculative loop) every N steps",
    "eval_at": "also measure it after these steps, e.g. 250,500,1000,2000,4000 (a learning curve's points)",
    "data_rows": "START:STOP, rows of an answers directory (python -m dflash.data answers) to train on, in order "
                 "of writing (e.g. 0:20000; another run can take 20000: and never see them)",
    "eval_at_start": "also evaluate the untrained drafter before the first step (the curve's baseline; costs one "
                     "full evaluation)",
    "eval_data": "held-out prompts (JSONL / datasets dir) for the acceptance measurement",
    "eval_holdout": "hold out this many training samples and evaluate on their prompts",
    "eval_at_end": "measure the exported drafter on the held-out prompts, --eval-max-prompts x --eval-max-new-tokens "
                   "through the speculative loop (default true; --no-eval-at-end skips it)",
    "eval_max_prompts": "prompts per evaluation",
    "eval_max_new_tokens": "tokens generated per evaluation prompt",
    "log_every": "write a log row every N steps",
    "progress": "tqdm progress bar",
    "plot": "write curves.png (loss and tau) at the end",
    "push_to_hub": "upload the exported drafter to this hub repo at the end",
    "quiet": "no console output",
}


# Presets over TrainConfig's defaults (which are the "default" recipe). The paper's: HF-style random init of the
# draft layers and the position-weighted CE on the data tokens only (no soft label).
RECIPES = {"default": {}, "paper": {"init_layers": "random", "kl_weight": 0.0}}


def _field_types():
    from .core.training.train_config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    return TrainConfig, [(f, hints[f.name]) for f in dataclasses.fields(TrainConfig)
                         if f.name not in ("samples", "eval_prompts")]


def _scalar(tp):
    """The scalar parser of a (possibly Optional) annotation."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    return typing.get_origin(base) or base


def _convert(name: str, tp, value):
    kind = _scalar(tp)
    flag = "--" + name.replace("_", "-")
    if value is None:
        return None
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind in (list, tuple):
            items = value if isinstance(value, (list, tuple)) else [x for x in str(value).split(",") if x.strip()]
            inner = {"target_layer_ids": int, "layer_types": str}.get(name, float)
            return kind(inner(x) for x in items)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise DFlashError(f"{flag}: cannot read {value!r} as {getattr(kind, '__name__', kind)}") from None


def parse_args(argv=None):
    _, fields = _field_types()
    p = cli.Parser(prog="python -m dflash.train", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch", help="training backend (torch)")
    p.add_argument("--config", help="YAML or JSON file of hyperparameters (flags override it)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="default",
                   help="default: this project's measured recipe (docs/training.md); paper: the DFlash paper's "
                        "(random init, CE only). A --config file and explicit flags override it")
    p.add_argument("--init-from-target", action="store_true", help="new drafter shaped from the target (default)")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    for f, tp in fields:
        flag = "--model" if f.name == "target" else "--" + f.name.replace("_", "-")
        text = HELP.get(f.name, "") + _default_note(f)
        if _scalar(tp) is bool:
            p.add_argument(flag, dest=f.name, nargs="?", const="true", default=argparse.SUPPRESS, metavar="BOOL",
                           help=text)
            if f.default is True:
                p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const", const="false",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar=f.name.upper(), help=text)
    return p.parse_args(argv)


def _default_note(f) -> str:
    """' (default X)', unless there is no default value to show or the help text already explains it."""
    default = f.default if f.default is not dataclasses.MISSING else None
    if default in (None, "") or "default" in HELP.get(f.name, ""):
        return ""
    if isinstance(default, bool):
        default = str(default).lower()
    elif isinstance(default, tuple):
        default = ",".join(str(x) for x in default)
    return f" (default {default})"


def load_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise DFlashError(f"--config: {p} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(f"{p}: cannot parse ({first})") from None
    if not isinstance(data, dict):
        raise DFlashError(f"{p}: expected a mapping of hyperparameters")
    return data


def config_from_args(args):
    TrainConfig, fields = _field_types()
    types = {f.name: tp for f, tp in fields}
    values = dict(RECIPES[args.recipe])
    if args.config:
        for key, value in load_config_file(args.config).items():
            name = key.replace("-", "_")
            name = "target" if name == "model" else name
            if name not in types:
                raise DFlashError(f"{args.config}: unknown key '{key}' (see python -m dflash.train --help)")
            values[name] = _convert(name, types[name], value)
    for name in types:
        if hasattr(args, name):
            values[name] = _convert(name, types[name], getattr(args, name))
    if args.init_from_target and values.get("init_from"):
        raise DFlashError("--init-from-target: conflicts with --init-from; pick one")
    return TrainConfig(**values)


def run_training(cfg):
    """A run as the command starts it: --out checked and the target resolved (a hub id or a directory) before
    anything loads, the backend's run, then (on the main process) the curves and the hub upload."""
    from dflash import hub
    from dflash.backends.torch.training import train
    from dflash.backends.torch.training.run import check_config
    from dflash.core.io import check_output_dir

    check_output_dir(cfg.out, "--out")  # created only once the inputs are validated: a refused run leaves nothing
    check_config(cfg)
    check_pushable(cfg)
    result = train(cfg, hub.resolve(cfg.target, "--model"))
    if int(os.environ.get("RANK", "0")) == 0:
        if cfg.plot and can_plot("train"):
            plot_curves(Path(cfg.out) / "train_log.jsonl", Path(cfg.out) / "curves.png")
        if cfg.push_to_hub:
            push_to_hub(result.draft_dir, cfg.push_to_hub)
    return result


def check_pushable(cfg) -> None:
    """--push-to-hub with a drafter the public format cannot hold (an ablation mode) fails before the run."""
    if not cfg.push_to_hub:
        return
    if cfg.init_from:
        from .core.spec import DraftSpec

        DraftSpec.load(cfg.init_from).check_public("--push-to-hub")
    elif cfg.context_mode != "kv":
        raise DFlashError(f"--push-to-hub: --context-mode {cfg.context_mode} is an ablation mode of the torch backend "
                          "only; the public DFlash format (vLLM, SGLang) has K/V injection (context_mode kv) only")


def plot_curves(log_path: Path, png: Path) -> None:
    """curves.png: the training loss and the acceptance length of every evaluation, against the step."""
    plt = pyplot("--plot")
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "tau" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows])
    axes[0].set(xlabel="step", ylabel="loss", title="training loss")
    axes[1].plot([r["step"] for r in eval_rows], [r["tau"] for r in eval_rows], marker="o")
    axes[1].set(xlabel="step", ylabel="tau", title="acceptance length (speculative loop, greedy)")
    save(fig, png, dpi=100)


def push_to_hub(draft_dir: Path, repo: str) -> None:
    from .core.spec import DraftSpec

    DraftSpec.load(draft_dir).check_public("--push-to-hub")  # the hub is where vLLM and SGLang load drafters from
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=str(draft_dir), repo_id=repo)
    except Exception as e:  # network, auth: the local export is already done
        raise DFlashError(f"--push-to-hub {repo}: upload failed ({type(e).__name__}: {e})") from None


def main(argv=None) -> int:
    args = parse_args(argv)  # before any framework import: --help and flag errors answer at once
    if args.backend != "torch":
        raise DFlashError(f"--backend: training supports torch only, got {args.backend!r}")
    cfg = config_from_args(args)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise DFlashError("torch is not installed; training needs it: pip install 'dflash[torch,train]'") from None
    import torch.distributed as dist

    result = run_training(cfg)
    if dist.is_available() and dist.is_initialized():
        # every rank reaches here before any tears its group down (a rank that closes its sockets while a peer is
        # still in a collective aborts that peer); after a failure the group is left alone: destroying it while
        # another rank is in a collective hangs, and torchrun stops the others
        dist.barrier()
        dist.destroy_process_group()
    if not cfg.quiet and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"draft": str(result.draft_dir), "steps": result.steps,
                          "final_loss": result.losses[-1] if result.losses else None, "tau": result.tau,
                          "seconds": round(result.seconds, 1)}))
    return 0


if __name__ == "__main__":
    code = cli.run(main)
    # Trained and exported (every file closed, the process group destroyed): skip the interpreter's teardown, which
    # destroys torch's native thread pools under threads that may still run and once aborted a torchrun rank after
    # its run had finished ("terminate called without an active exception", SIGABRT), as it did the server's
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
