"""A transformers target -> an MLX target (optionally quantized), through mlx-lm's own converter."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from dflash.core.extras.deps import install_hint
from dflash.core.errors import DFlashError
from dflash.core.io import atomic_directory
from dflash.core.model_files.target_config import write_legacy_fields

from .quantize import check_params


def target_to_mlx(model_dir: str | os.PathLike, out_dir: str | os.PathLike, quantize: bool = False, bits: int = 4,
                  group_size: int = 64, dtype: str | None = None, trust_remote_code: bool = False,
                  quiet: bool = False) -> Path:
    try:
        from mlx_lm.convert import convert
    except ImportError:
        raise DFlashError(f"target-to-mlx: needs the 'mlx-lm' package ({install_hint('mlx_lm')})") from None
    if quantize:
        check_params(bits, group_size)
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise DFlashError(f"--dtype: got {dtype!r}, expected float32, bfloat16 or float16")
    from dflash.core.model_files.checkpoint import check_target_dir
    from .draft import check_out

    check_target_dir(model_dir)  # before mlx-lm reads it: broken config or truncated weights get one line
    out = check_out(out_dir, model_dir)
    with atomic_directory(out) as tmp:
        tmp.rmdir()  # mlx-lm refuses to write into an existing directory
        sink = io.StringIO() if quiet else None
        try:
            with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
                convert(str(model_dir), mlx_path=str(tmp), quantize=quantize, q_bits=bits if quantize else None,
                        q_group_size=group_size if quantize else None, dtype=dtype,
                        trust_remote_code=trust_remote_code)
        except (ValueError, OSError, KeyError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DFlashError(f"{model_dir}: mlx-lm could not convert the target ({first})") from None
        write_legacy_fields(tmp)  # mlx-lm copies the config as it is: a transformers-5 one keeps RoPE nested
    return out
