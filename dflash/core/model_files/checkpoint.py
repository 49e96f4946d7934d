"""The canonical DFlash drafter checkpoint: config.json + model.safetensors (optionally sharded with an index).

Backend-neutral validation lives here: the expected tensor names and shapes for a DraftSpec, and a reader of the
safetensors header that catches truncated or corrupted files before any framework touches them. Loaders must
reject missing, unexpected or mis-shaped weights: silently skipping a name loads random weights.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..errors import DFlashError
from ..io import read_json_config
from ..spec import WEIGHTS_NAME, DraftSpec

INDEX_NAME = "model.safetensors.index.json"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U32": 4, "U16": 2, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
# prefixes trainers and wrappers leave in front of the canonical names
_KNOWN_PREFIXES = ("model.", "module.", "_orig_mod.", "draft_model.", "drafter.", "_fsdp_wrapped_module.")


def expected_shapes(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    h, hd, nh, nkv, ff = (spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads,
                          spec.intermediate_size)
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.uses_target_features:  # the ablation drafter without target features has no projection
        shapes.update({"fc.weight": (h, h * spec.num_context_layers), "hidden_norm.weight": (h,)})
    shapes["norm.weight"] = (h,)
    for i in range(spec.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if spec.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nh * hd,), p + "self_attn.k_proj.bias": (nkv * hd,),
                           p + "self_attn.v_proj.bias": (nkv * hd,), p + "self_attn.o_proj.bias": (h,)})
        if spec.is_dflash2:
            assert spec.conv_kernel_size and spec.conv_group_size  # (a DFlash2 spec has them: DraftSpec.validate)
            taps, groups = spec.conv_kernel_size, h // spec.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):  # [side (before / after the sublayer), tap, channel]
                shapes[p + conv + ".base_kernel"] = (2, taps, h)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * taps * groups, h)
    if spec.is_dflash2:  # the codebooks are stored without a '.weight' suffix
        assert spec.selector_rank
        shapes.update({"candidate_selector.predecessor_codebook": (spec.vocab_size, spec.selector_rank),
                       "candidate_selector.successor_codebook": (spec.vocab_size, spec.selector_rank),
                       "candidate_selector.hidden_projection.weight": (spec.selector_rank, h)})
    if spec.has_draft_vocab:  # dflash.core.draft_vocab: its own head and the two maps
        shapes.update({"lm_head.weight": (spec.draft_vocab, h), "d2t": (spec.draft_vocab,),
                       "t2d": (spec.vocab_size,)})
    return shapes


# the dtypes of the draft vocabulary's maps (speculators writes int64 and bool; an int32 d2t reads the same)
VOCAB_MAP_DTYPES = {"d2t": ("I64", "I32"), "t2d": ("BOOL",)}


def read_header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} from a safetensors file, checking that the file is complete and well-formed."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise DFlashError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100_000_000):
                raise DFlashError(f"{path}: corrupted safetensors header (declared {n} bytes, file has {size})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DFlashError(f"{path}: corrupted safetensors header (not JSON)") from None
    except OSError as e:
        raise DFlashError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(header, dict):
        raise DFlashError(f"{path}: corrupted safetensors header")
    out, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            want = _DTYPE_BYTES[dtype]
            for d in shape:
                want *= d
            ok = isinstance(a, int) and isinstance(b, int) and 0 <= a <= b and min(shape, default=0) >= 0
        except (KeyError, TypeError, ValueError):
            raise DFlashError(f"{path}: corrupted safetensors entry for {name!r}") from None
        if not ok or b - a != want:
            raise DFlashError(f"{path}: corrupted safetensors entry for {name!r} (offsets {a}..{b}, expected "
                              f"{want} bytes)")
        end = max(end, b)
        out[name] = (dtype, shape)
    if 8 + n + end > size:
        raise DFlashError(f"{path}: truncated safetensors file ({size} bytes, header promises {8 + n + end})")
    return out


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (single file or sharded with an index)."""
    directory = Path(directory)
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise DFlashError(f"{index}: expected a JSON object with a 'weight_map'") from None
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise DFlashError(f"{index}: shard {missing[0]} is missing from {directory}")
        return [directory / s for s in shards]
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise DFlashError(f"{directory}: only pickle weights (*.bin/*.pt) found; DFlash loads safetensors only "
                          "(convert them with safetensors first)")
    raise DFlashError(f"{single}: missing; a DFlash drafter directory needs config.json and model.safetensors")


def check_target_dir(directory: str | os.PathLike) -> dict:
    """A target model directory, before any framework reads it: config.json is a JSON object and the weights are
    complete safetensors (model.safetensors, shards named by an index, or any *.safetensors); pickle-only weights
    are refused. Returns the config."""
    directory = Path(directory)
    path = directory / "config.json"
    cfg = read_json_config(path, "a target model directory needs config.json and *.safetensors weights")
    if not isinstance(cfg, dict):
        raise DFlashError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if (directory / WEIGHTS_NAME).is_file() or (directory / INDEX_NAME).is_file():
        files = weight_files(directory)
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(any(directory.glob(pattern)) for pattern in ("*.bin", "*.pt", "*.pth")):
            raise DFlashError(f"{directory}: only pickle weights (*.bin/*.pt) found; DFlash loads safetensors only "
                              "(convert them with safetensors first)")
        raise DFlashError(f"{directory}: no *.safetensors weights; a target model directory needs config.json and "
                          "*.safetensors weights")
    for f in files:
        read_header(f)
    return cfg


def validate_weights(spec: DraftSpec, directory: str | os.PathLike, allow_quantized: bool = False) -> list[Path]:
    """Check names and shapes of every tensor against the spec; return the files to load.

    A drafter quantized by `dflash.convert quantize` (config.json 'quantization', mlx-lm's key) only loads where
    `allow_quantized` (the MLX backend); elsewhere it is refused with one line rather than misread."""
    quant = spec.extra.get("quantization")
    if quant is not None and not allow_quantized:
        bits = quant.get("bits") if isinstance(quant, dict) else quant
        raise DFlashError(f"{Path(directory) / 'config.json'}: this drafter is MLX-quantized ({bits}-bit); only "
                          "--backend mlx loads it (use the unquantized checkpoint here)")
    files = weight_files(directory)
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        for name, (dtype, shape) in read_header(f).items():
            found[name] = shape
            if name in VOCAB_MAP_DTYPES and spec.has_draft_vocab and dtype not in VOCAB_MAP_DTYPES[name]:
                raise DFlashError(f"{f}: tensor '{name}' has dtype {dtype}, expected "
                                  f"{' or '.join(VOCAB_MAP_DTYPES[name])} (the draft vocabulary's map)")
    want = None
    if quant is not None:
        want = quantized_shapes(spec, quant, found, str(Path(directory) / "config.json"))
    check_names_and_shapes(spec, found, str(files[0]) if len(files) == 1 else str(directory), want)
    return files


def quantized_shapes(spec: DraftSpec, quant, found: dict, source: str) -> dict[str, tuple[int, ...]]:
    """Expected tensor shapes of a quantized drafter: a Linear is quantized exactly when its scales are present."""
    if not isinstance(quant, dict) or not isinstance(quant.get("bits"), int) or \
            not isinstance(quant.get("group_size"), int):
        raise DFlashError(f"{source}: field 'quantization' must be an object with integer bits and group_size")
    if quant.get("mode", "affine") != "affine":
        raise DFlashError(f"{source}: quantization mode {quant.get('mode')!r} is not supported, expected 'affine'")
    bits, group = quant["bits"], quant["group_size"]
    want: dict[str, tuple[int, ...]] = {}
    for name, (out, *rest) in expected_shapes(spec).items():
        prefix = name[: -len(".weight")]
        if rest and name.endswith(".weight") and f"{prefix}.scales" in found:
            (inp,) = rest
            want[name] = (out, inp * bits // 32)
            want[f"{prefix}.scales"] = want[f"{prefix}.biases"] = (out, inp // group)
        else:
            want[name] = (out, *rest)
    return want


def common_prefix(names) -> str:
    """The stack of known wrapper prefixes every name starts with ('_orig_mod.model.' counts), or ''."""
    names, stack = list(names), ""
    while names:
        p = next((p for p in _KNOWN_PREFIXES if all(n.startswith(p) for n in names)), None)
        if p is None:
            break
        names = [n[len(p):] for n in names]
        stack += p
    return stack


def check_names_and_shapes(spec: DraftSpec, found: dict[str, tuple[int, ...]], source: str,
                           want: dict[str, tuple[int, ...]] | None = None) -> None:
    want = want if want is not None else expected_shapes(spec)
    missing = [k for k in want if k not in found]
    unexpected = [k for k in found if k not in want]
    if missing or unexpected:
        prefix = common_prefix(found)
        if prefix and missing and set(k[len(prefix):] for k in found) >= set(missing):
            raise DFlashError(f"{source}: weight names carry the prefix '{prefix}' left by a trainer (e.g. "
                              f"'{prefix}{missing[0]}'); expected canonical names like '{missing[0]}' "
                              f"(fix: python -m dflash.convert strip-prefix)")
        if any(k.startswith(("embed_tokens", "lm_head", "model.embed_tokens")) for k in unexpected):
            name = next(k for k in unexpected if k.startswith(("embed_tokens", "lm_head", "model.embed_tokens")))
            raise DFlashError(f"{source}: unexpected weight {name!r}; a DFlash drafter shares the target's "
                              "embedding and LM head and must not contain its own (only a drafter with a "
                              "draft vocabulary, config.json 'draft_vocab_size', has an lm_head)")
        if missing:
            raise DFlashError(f"{source}: missing weight {missing[0]!r}" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        raise DFlashError(f"{source}: unexpected weight {unexpected[0]!r}" +
                          (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for k, shape in want.items():
        if tuple(found[k]) != shape:
            raise DFlashError(f"{source}: weight '{k}' has shape {list(found[k])}, expected {list(shape)} "
                              "(from config.json)")


def load_pair(draft_dir, spec: DraftSpec | None, load_target, target_info, load_drafter, *,
              backend: str | None = None):
    """The load sequence every backend follows: the drafter's config is read and checked first (its errors come
    before the slow target load), then the target, then the drafter against the target's shapes, then its weights.
    load_target() -> target; target_info(target) -> TargetInfo; load_drafter(target, spec) -> drafter. `backend`: a backend
    that runs public drafters only names itself in the refusal of an ablation drafter. Returns (target, drafter)."""
    if draft_dir is not None:
        spec = spec or DraftSpec.load(draft_dir)
        if backend is not None:
            spec.check_public(f"--backend {backend} ({draft_dir})")
    target = load_target()
    if draft_dir is None:
        return target, None
    assert spec is not None  # (read above)
    spec.validate_against(target_info(target), source=str(draft_dir))
    return target, load_drafter(target, spec)
