"""Model ids -> local directories through huggingface_hub, and the registry of known target/draft pairs.

Downloads go to the standard HF cache (HF_HOME, HF_HUB_OFFLINE and tokens are honoured by huggingface_hub itself),
and only the files a model needs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import DFlashError

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

# target model id -> public DFlash drafter id (z-lab); --draft overrides
REGISTRY: dict[str, str] = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
}


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def resolve(name_or_path: str | os.PathLike, flag: str = "--model") -> Path:
    """A local directory as is, or a hub id downloaded (or found) in the HF cache."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{flag}: {path} is a file, expected a model directory or a hub id")
        if not any(path.iterdir()):
            raise DFlashError(f"{flag}: {path} is an empty directory")
        return path
    name = str(name_or_path)
    if not is_repo_id(name):
        raise DFlashError(f"{flag}: {name!r} is neither an existing directory nor a hub id like 'org/name'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError:
        raise DFlashError(f"{flag}: {name} is not in the local HF cache and the hub is unreachable or offline; "
                          f"fetch it first with: huggingface-cli download {name}") from None
    except RepositoryNotFoundError:
        raise DFlashError(f"{flag}: {name} was not found on the hub (private repos need HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise DFlashError(f"{flag}: downloading {name} failed ({str(e).splitlines()[0]})") from None


def draft_for(model: str) -> str | None:
    """The registered drafter for a target id (also matches ids whose last component matches)."""
    if model in REGISTRY:
        return REGISTRY[model]
    tail = str(model).rstrip("/").split("/")[-1].lower()
    for target, draft in REGISTRY.items():
        if target.split("/")[-1].lower() == tail:
            return draft
    return None
