"""Backends: each subpackage exposes `load(target_dir, draft_dir, **options) -> Engine` over its Target and Drafter
(dflash/core/contract.py)."""

from __future__ import annotations

import importlib
import platform

from dflash.core.extras.deps import install_hint, installed
from dflash.core.errors import DFlashError

BACKENDS = ("torch", "mlx")
_LIBRARIES = {"torch": ("torch",), "mlx": ("mlx", "mlx_lm")}  # what each backend runs on


def missing_library(name: str) -> str | None:
    """The first library backend `name` needs that is not installed, or None."""
    return next((lib for lib in _LIBRARIES[name] if not installed(lib)), None)


def available(name: str) -> bool:
    return missing_library(name) is None


def pick(name: str = "auto") -> str:
    """--backend auto: MLX on Apple silicon, PyTorch elsewhere; whichever is installed when only one is."""
    if name == "auto":
        apple_silicon = platform.system() == "Darwin" and platform.machine() == "arm64"
        preferred = ("mlx", "torch") if apple_silicon else ("torch", "mlx")
        for candidate in preferred:
            if available(candidate):
                return candidate
        raise DFlashError("--backend auto: neither PyTorch nor MLX is installed "
                          f"({install_hint('torch')}, or '.[mlx]')")
    if name not in BACKENDS:
        raise DFlashError(f"--backend: got {name!r}, expected one of auto, {', '.join(BACKENDS)}")
    return name


def get(name: str):
    """The backend package `dflash.backends.<name>`, with a clear line when its library is not installed."""
    name = pick(name)
    module = missing_library(name)
    if module is not None:
        raise DFlashError(f"--backend {name}: the '{module}' package is not installed ({install_hint(module)})")
    return importlib.import_module(f"dflash.backends.{name}")
