"""MLX quantization of a DFlash drafter (the MLX backend loads it; the torch backend refuses it with one line).

The format is mlx-lm's: every quantized Linear `p` stores `p.weight` (uint32, packed), `p.scales` and `p.biases`,
and config.json records {"group_size", "bits", "mode"} under "quantization" (and "quantization_config"). A Linear
whose input size is not a multiple of the group size stays in floating point, as mlx-lm does.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash.core.model_files.checkpoint import validate_weights
from dflash.core.extras.deps import install_hint
from dflash.core.errors import DFlashError
from dflash.core.spec import WEIGHTS_NAME, DraftSpec


BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def check_params(bits: int, group_size: int, source: str = "--bits") -> None:
    if bits not in BITS:
        raise DFlashError(f"{source}: got {bits}, expected one of {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        raise DFlashError(f"--group-size: got {group_size}, expected one of {', '.join(map(str, GROUP_SIZES))}")


def quantize_drafter(draft_dir: str | os.PathLike, out_dir: str | os.PathLike, bits: int = 4,
                     group_size: int = 64) -> Path:
    """Quantize every Linear of a canonical drafter with mx.quantize; write config.json + model.safetensors."""
    check_params(bits, group_size)
    try:
        import mlx.core as mx
    except ImportError:
        raise DFlashError(f"quantize: needs the 'mlx' package ({install_hint('mlx')})") from None
    from dflash.core.io import atomic_directory

    from .draft import check_out

    out_dir = check_out(out_dir, draft_dir)
    spec = DraftSpec.load(draft_dir)
    spec.check_public("quantize")  # an MLX-quantized drafter runs on the MLX backend only
    if spec.extra.get("quantization") is not None:
        raise DFlashError(f"{Path(draft_dir) / 'config.json'}: the drafter is already quantized")
    files = validate_weights(spec, draft_dir)
    weights: dict[str, mx.array] = {}
    for f in files:
        loaded = mx.load(str(f))
        assert isinstance(loaded, dict)  # (a .safetensors file: its tensors by name)
        weights.update(loaded)
    out = {}
    for name, w in weights.items():
        # Linears only: DFlash2's codebooks (2-D, no '.weight') are gathered by row and stay in floating point
        if w.ndim == 2 and name.endswith(".weight") and w.shape[-1] % group_size == 0:
            q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
            prefix = name[: -len(".weight")]
            out[name], out[prefix + ".scales"], out[prefix + ".biases"] = q, scales, biases
        else:
            out[name] = w
    mx.eval(out)
    quant = {"group_size": group_size, "bits": bits, "mode": "affine"}
    spec.extra["quantization"] = quant
    spec.extra["quantization_config"] = dict(quant)
    with atomic_directory(out_dir) as tmp:
        mx.save_safetensors(str(tmp / WEIGHTS_NAME), out, metadata={"format": "mlx"})
        spec.save(tmp)
    return out_dir
