"""The bundled reference pair: a small Qwen3 target pretrained on the standard library's Python source and a DFlash
drafter trained on that target's own answers, both float16 safetensors inside the package, so
`python -m dflash.generate --prompt "def fib(n):"` works offline with no --model.

Rebuild (fixed seeds; docs/reference.md has the costs and curves):  python -m dflash.reference build
"""

from __future__ import annotations

from pathlib import Path

from dflash.core.errors import DFlashError

ASSETS = Path(__file__).with_name("assets")
TARGET_DIR = ASSETS / "target"
DRAFT_DIR = ASSETS / "draft"
_NEEDED = {TARGET_DIR: ("config.json", "model.safetensors", "tokenizer.json"),
           DRAFT_DIR: ("config.json", "model.safetensors")}


def reference_dirs() -> tuple[Path, Path]:
    """(target directory, drafter directory) of the bundled pair."""
    for directory, names in _NEEDED.items():
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise DFlashError(f"{directory / missing[0]}: the bundled reference model is missing (a source checkout "
                              "without its assets?); pass --model, or rebuild it with: python -m dflash.reference "
                              "build --install")
    return TARGET_DIR, DRAFT_DIR


__all__ = ["reference_dirs", "ASSETS", "TARGET_DIR", "DRAFT_DIR"]
