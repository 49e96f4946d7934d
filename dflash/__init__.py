"""DFlash: block-diffusion speculative decoding on PyTorch and MLX (one core loop, one checkpoint format)."""

from .core.extras.deps import quiet_transformers_without_torch
from .core.errors import DFlashError
from .core.sampling import SamplingParams

quiet_transformers_without_torch()

__version__ = "0.1.0"


def load(*args, **kwargs):
    """See dflash.api.load."""
    from .api import load as _load

    return _load(*args, **kwargs)


__all__ = ["DFlashError", "SamplingParams", "load"]
