"""Backends: each subpackage exposes `load(target_dir, draft_dir, **options) -> Backend` (see base.py)."""

from __future__ import annotations

import importlib
import platform

from dflash.errors import DFlashError

BACKENDS = ("torch", "mlx")
_PACKAGES = {"torch": ("torch", "pip install 'dflash[torch]'"), "mlx": ("mlx", "pip install 'dflash[mlx]'")}


def available(name: str) -> bool:
    try:
        importlib.import_module(_PACKAGES[name][0])
        return True
    except ImportError:
        return False


def pick(name: str = "auto") -> str:
    """--backend auto: MLX on Apple silicon, PyTorch elsewhere."""
    if name == "auto":
        if platform.system() == "Darwin" and platform.machine() == "arm64" and available("mlx"):
            return "mlx"
        return "torch"
    if name not in BACKENDS:
        raise DFlashError(f"--backend: got {name!r}, expected one of auto, {', '.join(BACKENDS)}")
    return name


def get(name: str):
    """The backend package `dflash.backends.<name>`, with a clear line when its library is not installed."""
    name = pick(name)
    module, hint = _PACKAGES[name]
    if not available(name):
        raise DFlashError(f"--backend {name}: the '{module}' package is not installed ({hint})")
    return importlib.import_module(f"dflash.backends.{name}")
