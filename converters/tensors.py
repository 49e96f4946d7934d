"""Reading and writing safetensors with numpy alone (bfloat16 kept as raw 16-bit words), so the canonical-format
converters run the same on a CUDA box without MLX and on a Mac without torch."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from dflash.core.model_files.checkpoint import read_header

_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_, "U32": np.uint32,
          "U16": np.uint16, "U64": np.uint64}
FLOATS = ("F64", "F32", "F16", "BF16")
DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def read_tensors(path: str | os.PathLike) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, array)}; the header is validated first (truncation, offsets)."""
    from dflash.core.errors import DFlashError

    header = read_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = json.loads(f.read(n))
        data = f.read()
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, (dtype, shape) in header.items():
        if dtype not in _NUMPY:
            raise DFlashError(f"{path}: tensor '{name}' has dtype {dtype}, which the converters do not handle")
        a, b = raw[name]["data_offsets"]
        out[name] = (dtype, np.frombuffer(data[a:b], dtype=_NUMPY[dtype]).reshape(shape))
    return out


def write_tensors(path: str | os.PathLike, tensors: dict[str, tuple[str, np.ndarray]],
                  metadata: dict[str, str] | None = None) -> None:
    """Write safetensors (callers wrap this in dflash.core.io.atomic_path / atomic_directory)."""
    header: dict[str, object] = {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        dtype, array = tensors[name]
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    header["__metadata__"] = metadata or {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(Path(path), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in chunks:
            f.write(blob)


def to_float32(dtype: str, array: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def from_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> F32 / F16 / BF16 with round-to-nearest-even (what torch's .to() does)."""
    if dtype == "F32":
        return array.astype(np.float32)
    if dtype == "F16":
        return array.astype(np.float16)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded)


def convert(dtype: str, array: np.ndarray, want: str) -> tuple[str, np.ndarray]:
    """Cast a floating tensor to `want` (a safetensors dtype name); other tensors pass through."""
    if dtype not in FLOATS or dtype == want:
        return dtype, array
    return want, from_float32(to_float32(dtype, array), want)
