"""A GGUF file (llama.cpp's format) -> a canonical transformers directory, through transformers' own GGUF support.

transformers dequantizes the file into an ordinary model (`from_pretrained(..., gguf_file=...)`) but will not
`save_pretrained` it (a GGUF-quantized model is "not serializable"), so the dense weights are written here with
safetensors, next to the config without its quantization block (its RoPE keys in both the transformers-5 and the
older layout: dflash.core.model_files.target_config), the tokenizer with its chat template and the
generation config: a plain directory every loader of this project (and any other) reads.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

from dflash.core.model_files.checkpoint import check_target_dir
from dflash.core.extras.deps import require
from dflash.core.errors import DFlashError
from dflash.core.io import atomic_directory
from dflash.core.model_files.target_config import write_legacy_fields

from .draft import check_out

MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16", "float16")


def check_gguf(path: str | os.PathLike) -> Path:
    """An existing file that starts with the GGUF magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DFlashError(f"--gguf: {path} {'is a directory' if path.is_dir() else 'does not exist'}; expected a "
                          ".gguf file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise DFlashError(f"--gguf: {path} is not a GGUF file (it starts with {head!r}, expected {MAGIC!r})")
    return path


def require_packages(needed_by: str) -> None:
    for module in ("torch", "gguf", "accelerate"):  # transformers' GGUF loader needs all three
        require(module, needed_by)


def architecture(path: Path) -> str:
    """general.architecture, read with gguf's own reader (for the error lines)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
        return str(field.contents()) if field is not None else "unnamed"
    except (ValueError, KeyError, IndexError) as e:  # a tensor type or a value this gguf does not know
        raise DFlashError(f"--gguf: {path}: the gguf package cannot read it ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Dequantize `gguf_file` into `out_dir` (config.json, model.safetensors in `dtype`, tokenizer, chat template,
    generation_config.json). The directory appears only when complete."""
    if dtype not in DTYPES:
        raise DFlashError(f"--dtype: got {dtype!r}, expected one of {', '.join(DTYPES)}")
    path = check_gguf(gguf_file)
    require_packages("convert gguf")
    out = check_out(out_dir, path.parent)
    arch = architecture(path)

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # dense weights whatever GGUF kernels are installed: packed blocks cannot be saved (transformers before GgufConfig
    # always dequantizes)
    dense = {"quantization_config": transformers.GgufConfig(dequantize=True)} \
        if hasattr(transformers, "GgufConfig") else {}
    # (tens of seconds on a CPU for a 100 MB file, silent unless transformers shows its bar: say what runs)
    print(f"dflash: dequantizing {path.name} ({path.stat().st_size / 2**20:.0f} MB, '{arch}') to {dtype} with "
          "transformers' GGUF loader, then writing it ...", file=sys.stderr, flush=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype),
                                                     **dense)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, NotImplementedError, KeyError, TypeError) as e:
        raise DFlashError(f"--gguf: {path}: transformers {transformers.__version__} cannot convert this "
                          f"'{arch}' GGUF ({_first_line(e)})") from None

    config = copy.deepcopy(model.config)
    # the loading state (the GGUF quantization block, the file's general.name as a path) is not part of the model
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = [type(model).__name__]
    config.dtype = dtype

    with atomic_directory(out) as tmp:
        save_file(_unique_tensors(model.state_dict()), tmp / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
        write_legacy_fields(tmp)  # rope_theta etc. at the top level too, where mlx-lm's ModelArgs read them
        tokenizer.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        check_target_dir(tmp)
    return out


def _unique_tensors(state: dict) -> dict:
    """Contiguous tensors, each storage once: a tied output embedding is the input embedding, and transformers ties
    it again at load from tie_word_embeddings (safetensors refuses shared storage)."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out
