"""Checkpoints that survive SIGKILL, one written when Ctrl-C or SIGTERM stops a run, and the exported drafter.

  runs/X/checkpoints/step_N/  model.pt, optimizer.pt (full, unsharded), trainer.pt (step), rng_rank{r}.pt, DONE
Built in a hidden temporary directory, fsynced, then renamed: a directory without DONE never counts. Everything
loads with torch.load(weights_only=True). The data position and LR follow from the step (training/data.py), and the
log is cut back to the checkpoint's step, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch

from dflash.core.errors import DFlashError

from ..drafter import DFlashDrafter, save_drafter
from .distributed import Dist


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


def full_model_state(module, drafter, fsdp: bool) -> dict:
    """The drafter's full weights with canonical names (collective under FSDP: every rank must call it)."""
    if not fsdp:
        return drafter.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("drafter."): v for k, v in sd.items()}


def full_state_dicts(module, optimizer, fsdp: bool):
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


def saved_at(out: Path, step: int) -> bool:
    """Whether the newest complete checkpoint is the one of `step`."""
    done = checkpoint_dirs(out)
    return bool(done) and done[-1].name == f"step_{step:08d}"


def save_checkpoint(out: Path, step: int, module, optimizer, fsdp: bool, d: Dist, keep: int,
                    run: dict | None = None) -> None:
    """Complete and atomic: every rank writes its RNG state into a temporary directory, rank 0 writes the weights,
    optimiser and trainer state (`run`: what fixes the run's sample order and schedule, which a resume checks), then
    renames the directory into place (a multi-node run needs a shared `out`)."""
    root = out / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    model_sd, optim_sd = full_state_dicts(module, optimizer, fsdp)  # collective under FSDP
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    torch.save(rng_state(), tmp / f"rng_rank{d.rank}.pt")
    d.barrier()
    if d.main:
        torch.save(model_sd, tmp / "model.pt")
        torch.save(optim_sd, tmp / "optimizer.pt")
        torch.save({"step": step, "world": d.world, "run": run or {}}, tmp / "trainer.pt")
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


def load_checkpoint(path: Path, module, optimizer, fsdp: bool, d: Dist, run: dict | None = None) -> int:
    load = lambda name: _load_weights_only(path / name)
    state = load("trainer.pt")
    # a checkpoint of another run (other rows, steps, batch or seed: another sample order) would go on with this
    # one's order from its step, seeing some samples twice and others never
    for key, was in (state.get("run") or {}).items():
        if run is not None and key in run and run[key] != was:
            raise DFlashError(f"{path}: written by a run with {key} {was!r}, this one has {run[key]!r}; rerun it "
                              "with the same settings, or pass a new --out (or --resume false) to start over")
    model_sd, optim_sd = load("model.pt"), load("optimizer.pt")
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


def resume(out: Path, cfg, module, optimizer, fsdp: bool, d, run: dict | None = None) -> tuple[int, list[dict]]:
    """(step to continue from, log rows the checkpoint covers). Rows a killed run logged past its last checkpoint
    are dropped from train_log.jsonl and replayed by the run. `run`: as save_checkpoint's, checked against the
    checkpoint's."""
    step = 0
    done = checkpoint_dirs(out) if cfg.resume else []
    if done:
        step = load_checkpoint(done[-1], module, optimizer, fsdp, d, run)
    rows = []
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / "train_log.jsonl"
        if log_path.is_file() and step > 0:
            rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("step", 0) <= step]
        log_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return step, rows


def export_drafter(module, drafter: DFlashDrafter, fsdp: bool, d, draft_dir: Path) -> None:
    """The canonical checkpoint (config.json + model.safetensors) of the trained weights (collective under FSDP)."""
    state = full_model_state(module, drafter, fsdp)
    if d.main:
        final = DFlashDrafter(drafter.spec)
        final.load_state_dict({k: v.cpu() for k, v in state.items()})
        save_drafter(final, draft_dir)


class StopRequests:
    """Ctrl-C (SIGINT) or SIGTERM during the steps: the first lets the current step finish, after which the loop
    writes a checkpoint and stops, so rerunning the command resumes there; a second stops at once, losing the steps
    since the last checkpoint. Installed only for one process in the main thread: the ranks of a distributed run see
    a signal at different steps while a checkpoint is collective, so they keep the periodic checkpoints."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal: str | None = None  # the name of the signal that asked the run to stop
        self.previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if self.enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"{self.signal}: stopping after this step and writing a checkpoint; send it again to stop at once, "
              "losing the steps since the last checkpoint", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

