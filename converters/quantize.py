"""MLX quantization of a DFlash drafter (the MLX backend loads it; the torch backend refuses it with one line).

The format is mlx-lm's: every quantized Linear `p` stores `p.weight` (uint32, packed), `p.scales` and `p.biases`,
and config.json records {"group_size", "bits", "mode"} under "quantization" (and "quantization_config"). A Linear
whose input size is not a multiple of the group size stays in floating point, as mlx-lm does.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash.deps import install_hint
from dflash.errors import DFlashError
from dflash.spec import WEIGHTS_NAME, DraftSpec

from .checkpoint import expected_shapes, validate_weights

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def check_params(bits: int, group_size: int, source: str = "--bits") -> None:
    if bits not in BITS:
        raise DFlashError(f"{source}: got {bits}, expected one of {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        raise DFlashError(f"--group-size: got {group_size}, expected one of {', '.join(map(str, GROUP_SIZES))}")


def quantized_shapes(spec: DraftSpec, quant, found: dict, source: str) -> dict[str, tuple[int, ...]]:
    """Expected tensor shapes of a quantized drafter: a Linear is quantized exactly when its scales are present."""
    if not isinstance(quant, dict) or not isinstance(quant.get("bits"), int) or \
            not isinstance(quant.get("group_size"), int):
        raise DFlashError(f"{source}: field 'quantization' must be an object with integer bits and group_size")
    if quant.get("mode", "affine") != "affine":
        raise DFlashError(f"{source}: quantization mode {quant.get('mode')!r} is not supported, expected 'affine'")
    bits, group = quant["bits"], quant["group_size"]
    want = {}
    for name, (out, *rest) in expected_shapes(spec).items():
        prefix = name[: -len(".weight")]
        if rest and name.endswith(".weight") and f"{prefix}.scales" in found:
            (inp,) = rest
            want[name] = (out, inp * bits // 32)
            want[f"{prefix}.scales"] = want[f"{prefix}.biases"] = (out, inp // group)
        else:
            want[name] = (out, *rest)
    return want


def quantize_drafter(draft_dir: str | os.PathLike, out_dir: str | os.PathLike, bits: int = 4,
                     group_size: int = 64) -> Path:
    """Quantize every Linear of a canonical drafter with mx.quantize; write config.json + model.safetensors."""
    check_params(bits, group_size)
    try:
        import mlx.core as mx
    except ImportError:
        raise DFlashError(f"quantize: needs the 'mlx' package ({install_hint('mlx')})") from None
    from dflash.io import atomic_directory

    from .draft import check_out

    out_dir = check_out(out_dir, draft_dir)
    spec = DraftSpec.load(draft_dir)
    if spec.extra.get("quantization") is not None:
        raise DFlashError(f"{Path(draft_dir) / 'config.json'}: the drafter is already quantized")
    files = validate_weights(spec, draft_dir)
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    out = {}
    for name, w in weights.items():
        if w.ndim == 2 and w.shape[-1] % group_size == 0:
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
