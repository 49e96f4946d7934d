"""Rewriting a drafter checkpoint into the canonical format: change its dtype, or strip a trainer's key prefix.

Every output is built in a temporary directory and swapped into place only when complete (dflash.core.io), and is
validated against its config before the swap: a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash.core.model_files.checkpoint import _KNOWN_PREFIXES, check_names_and_shapes, common_prefix, weight_files
from dflash.core.errors import DFlashError
from dflash.core.io import atomic_directory, check_output_dir
from dflash.core.spec import WEIGHTS_NAME, DraftSpec

from .tensors import DTYPE_NAMES, convert, read_tensors, write_tensors


def check_out(out_dir: str | os.PathLike, *inputs: str | os.PathLike) -> Path:
    """--out must be a new (or empty) directory, and not one of the inputs."""
    out = Path(out_dir)
    if any(out.resolve() == Path(i).resolve() for i in inputs):
        raise DFlashError(f"--out: {out} is the input directory; write the converted checkpoint somewhere new")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DFlashError(f"--out: {out} already exists and is not empty; choose a new directory")
    return check_output_dir(out, "--out")


def load_all(draft_dir: str | os.PathLike) -> dict:
    tensors = {}
    for f in weight_files(draft_dir):
        tensors.update(read_tensors(f))
    return tensors


def write_drafter(out_dir: Path, spec: DraftSpec, tensors: dict, source: str | None = None) -> Path:
    """Validate names/shapes (errors name `source`, the input), then write config.json + model.safetensors
    atomically as one directory."""
    check_names_and_shapes(spec, {k: v.shape for k, (_, v) in tensors.items()}, source or str(out_dir / WEIGHTS_NAME))
    with atomic_directory(out_dir) as tmp:
        write_tensors(tmp / WEIGHTS_NAME, tensors)
        spec.save(tmp)
    return out_dir


def convert_dtype(draft_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str) -> Path:
    if dtype not in DTYPE_NAMES:
        raise DFlashError(f"--dtype: got {dtype!r}, expected one of {', '.join(DTYPE_NAMES)}")
    out = check_out(out_dir, draft_dir)
    spec = DraftSpec.load(draft_dir)
    if spec.extra.get("quantization") is not None:
        raise DFlashError(f"{Path(draft_dir) / 'config.json'}: the drafter is quantized; convert the unquantized "
                          "checkpoint instead")
    want = DTYPE_NAMES[dtype]
    tensors = {k: convert(d, a, want) for k, (d, a) in load_all(draft_dir).items()}
    return write_drafter(out, spec, tensors, source=str(draft_dir))


def strip_prefix(draft_dir: str | os.PathLike, out_dir: str | os.PathLike, prefix: str | None = None) -> Path:
    """Remove a wrapper's key prefix ('model.', '_orig_mod.', 'module.', ... possibly stacked, or --prefix)."""
    out = check_out(out_dir, draft_dir)
    spec = DraftSpec.load(draft_dir)
    tensors = load_all(draft_dir)
    if prefix:
        stripped = prefix if all(k.startswith(prefix) for k in tensors) else ""
    else:
        stripped = common_prefix(tensors)
    if not stripped:
        what = f"the prefix '{prefix}'" if prefix else f"a known prefix ({', '.join(_KNOWN_PREFIXES)})"
        raise DFlashError(f"{weight_files(draft_dir)[0]}: not every weight name starts with {what}; nothing to "
                          "strip (pass --prefix to name it)")
    tensors = {k[len(stripped):]: v for k, v in tensors.items()}
    return write_drafter(out, spec, tensors, source=f"{draft_dir} (names without '{stripped}')")
