"""The reference target's autoregressive draft: the draft that transformers' assisted generation and mlx-lm's
speculative decoding need, so `python -m dflash.bench` can compare DFlash with them on equal terms on the bundled pair.

It is made by the benchmark's distiller (dflash/bench/ar_draft.py: the target's first layers under its own
embeddings, norm and head, distilled on its top-k next-token distributions) from the same target on the same data
as the DFlash drafter: the target's own greedy answers to the training prompts (the build's answers_chat.jsonl as
ChatML conversations and answers_completion.jsonl as plain completions, `python -m dflash.data regenerate` format;
an older build's answers.jsonl counts as chat). The packaged draft's ar_draft.json records the recipe it was built
with.

    python -m dflash.reference build-ar-draft               # from runs/reference (answers regenerated if absent)
    python -m dflash.reference build-ar-draft --install     # ... and store it in the package assets
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
from pathlib import Path

from dflash import cli
from dflash.core.errors import DFlashError
from dflash.core.io import cache_root
from dflash.core.training.ar_draft_config import ARDraftConfig

from . import ASSETS, TARGET_DIR

AR_DRAFT_DIR = ASSETS / "ar_draft"
NEEDED = ("config.json", "model.safetensors", "tokenizer.json")
ASSET_BUDGET_BYTES = 40 * 10**6  # the package's reference assets stay below this
# the bundled 8-layer target: 2 layers, float32 steps (any CPU), at most 20 minutes
SETTINGS = ARDraftConfig(layers=2, steps=300, batch_tokens=4096, lr=2e-3, warmup=30, heldout=12, max_length=512,
                          max_minutes=20, compute_dtype="float32", threads=2)


def _log(msg: str) -> None:
    print(f"[ar-draft] {msg}", flush=True)


def complete(directory: Path) -> bool:
    return all((Path(directory) / n).is_file() for n in NEEDED)


def target_fingerprint(target_dir: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(Path(target_dir) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def cache_dir_for(target_dir: Path = TARGET_DIR) -> Path:
    return cache_root() / "reference" / f"ar_draft-{target_fingerprint(target_dir)}"


def ensure_ar_draft(build_dir: str | Path = "runs/reference") -> Path:
    """The reference target's AR draft: the packaged one, else the cached one, else built now into the cache."""
    from . import reference_dirs

    if complete(AR_DRAFT_DIR):
        return AR_DRAFT_DIR
    target, _ = reference_dirs()
    cached = cache_dir_for(target)
    if complete(cached):
        return cached
    _log(f"no packaged AR draft; building one into {cached} (python -m dflash.reference build-ar-draft; minutes)")
    build(target, Path(build_dir), cached, SETTINGS)
    return cached


# ---- data ------------------------------------------------------------------------------------------------------------
# the build's plain-completion template (dflash/reference/build.py): the prompt as is, no markers
COMPLETION_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def answer_files(build_dir: Path) -> list[tuple[Path, str]]:
    """(answers file, format) of a reference build, format 'chat' or 'completion'."""
    found = [(build_dir / f"answers_{fmt}.jsonl", fmt) for fmt in ("chat", "completion")]
    found = [(p, fmt) for p, fmt in found if p.is_file()]
    if not found and (build_dir / "answers.jsonl").is_file():
        found = [(build_dir / "answers.jsonl", "chat")]
    return found


def answers_for(target_dir: Path, build_dir: Path) -> list[tuple[Path, str]]:
    """The build's answers, regenerated from the target (same prompts, same settings as the build) if absent."""
    found = answer_files(build_dir)
    if found:
        return found
    from . import build as B
    from .corpus import source_files, split
    from .prompts import training_prompts

    cfg = B.BuildConfig()
    formats = tuple(getattr(cfg, "answer_formats", ("chat",)))
    _log(f"no answers in {build_dir}: regenerating the target's answers to the {cfg.train_prompts} training prompts "
         f"({', '.join(formats)})")
    train_files, _ = split(source_files(limit_bytes=cfg.limit_bytes))
    prompts = training_prompts(train_files, limit=cfg.train_prompts, seed=cfg.seed,
                               max_chars=cfg.train_prompt_max_chars)
    build_dir.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        target = target_dir
        if fmt == "completion":
            target = build_dir / "completion_target"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(target_dir, target)
            (target / "chat_template.jinja").write_text(COMPLETION_TEMPLATE)
        B.regenerate(target, prompts, build_dir / f"answers_{fmt}.jsonl", cfg.answer_tokens)
    return answer_files(build_dir)


def load_answer_samples(target_dir: Path, files: list[tuple[Path, str]], max_length: int) -> list[dict]:
    """Tokenised samples (input_ids, loss_mask on the answer) of every answers file, each with its own template."""
    from dflash.core.training.datasets import load_samples
    from dflash.core.model_files.tokenizer import load_tokenizer

    samples = []
    for path, fmt in files:
        tok = load_tokenizer(target_dir)
        if fmt == "completion":
            tok.chat_template = COMPLETION_TEMPLATE
        samples += load_samples(path, tok, max_length=max_length)
    return samples


def build(target_dir: Path, build_dir: Path, out_dir: Path, settings: ARDraftConfig = SETTINGS) -> dict:
    """The draft of `target_dir`, distilled on the reference build's answers (regenerated if absent), in out_dir."""
    from dflash.backends.torch.ar_draft import build as distil  # torch, on first use
    from dflash.core.model_files.tokenizer import load_tokenizer

    answers = answers_for(Path(target_dir), Path(build_dir))
    samples = load_answer_samples(Path(target_dir), answers, settings.max_length)
    return distil(Path(target_dir), load_tokenizer(target_dir), samples, Path(out_dir), settings,
                  answers=[f"{path} ({fmt})" for path, fmt in answers], progress=False)


def assets_bytes(exclude: str | None = None) -> int:
    return sum(f.stat().st_size for d in ASSETS.iterdir() if d.is_dir() and d.name != exclude
               for f in d.rglob("*") if f.is_file()) if ASSETS.is_dir() else 0


def install(src: Path) -> None:
    """Copy into the package assets, only if all reference assets stay within ASSET_BUDGET_BYTES."""
    size = sum(f.stat().st_size for f in Path(src).iterdir() if f.is_file())
    total = assets_bytes(exclude="ar_draft") + size
    if total > ASSET_BUDGET_BYTES:
        raise DFlashError(f"--install: the reference assets would weigh {total / 1e6:.1f} MB with the AR draft "
                          f"(budget {ASSET_BUDGET_BYTES / 1e6:.0f} MB); keep it in the cache instead "
                          f"({cache_dir_for()})")
    shutil.rmtree(AR_DRAFT_DIR, ignore_errors=True)
    shutil.copytree(src, AR_DRAFT_DIR)
    _log(f"installed into {AR_DRAFT_DIR}: reference assets now {total / 1e6:.1f} MB")


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.reference build-ar-draft", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default="runs/reference", help="reference build directory holding answers_*.jsonl "
                   "(regenerated there if absent; default: runs/reference)")
    p.add_argument("--out", help="output directory (default: the cache, see --install)")
    p.add_argument("--install", action="store_true", help="copy into dflash/reference/assets/ar_draft (if the "
                   "assets stay <= 40 MB)")
    args = p.parse_args(argv)
    from . import reference_dirs

    target = reference_dirs()[0]
    out = Path(args.out) if args.out else cache_dir_for(target)
    summary = build(target, Path(args.build_dir), out)
    _log(f"saved {out} ({summary['steps']} steps, {summary['train_seconds']} s); held-out top-1 agreement with the "
         f"target {summary['before'].get('agreement')} -> {summary['after'].get('agreement')}")
    if args.install:
        install(out)
    return 0
