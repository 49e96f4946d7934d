"""Where the training step gets the target's hidden states from: one interface, two sources.

  OnlineFeatures  runs the frozen target on the batch (no grad, hooks on the needed layers only). The default:
                  nothing to precompute, no disk, always consistent with the target.
  FeatureCache    reads features written once by `python -m dflash.data cache-features` (sharded safetensors). Saves
                  the target forward in every epoch at the price of S * K * H values per sample on disk, and with
                  --top-k the target's k most likely next tokens at every position (the soft label of --kl-weight).

Both are called as `features(samples, input_ids) -> (b, S, K*H)` with the micro-batch's samples and padded ids, and
give the soft label's source with the features in one call (`with_final` online, `with_top` cached).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dflash.core.errors import DFlashError

from ..target import LayerCapture
from .objective import target_features

INDEX_NAME = "features.index.json"


class OnlineFeatures:
    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.capture = LayerCapture(model, layer_ids)

    def __call__(self, samples, input_ids: torch.Tensor) -> torch.Tensor:
        # right padding: a causal target never lets a real position see the pads after it, so no attention mask
        return target_features(self.model, self.capture, input_ids)

    def with_final(self, samples, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, the target's final-normed hidden states): the second gives the target's next-token
        distribution at every position (the soft label of --kl-weight) from the same forward."""
        return target_features(self.model, self.capture, input_ids, final=True)

    def close(self) -> None:
        self.capture.remove()


class FeatureCache:
    """Samples and their features from a cache-features directory. Samples keep their "index" into the cache."""

    def __init__(self, directory: str | os.PathLike, device="cpu", dtype: torch.dtype | None = None):
        from safetensors import safe_open

        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        if not index_path.is_file():
            raise DFlashError(f"{index_path}: missing; --features must be a directory written by "
                              "`python -m dflash.data cache-features`")
        self.index = json.loads(index_path.read_text())
        self.device, self.dtype = device, dtype
        self._files: dict[str, Any] = {}  # name -> its open safetensors file
        self._open = lambda name: self._files.setdefault(
            name, safe_open(str(self.directory / name), framework="pt", device="cpu"))

    @property
    def target_layer_ids(self) -> list[int]:
        return self.index["target_layer_ids"]

    @property
    def top_k(self) -> int:
        """How many of the target's most likely next tokens each position keeps (0: none were cached)."""
        return int(self.index.get("top_k", 0))

    def samples(self) -> list[dict]:
        out = []
        for i, entry in enumerate(self.index["samples"]):
            f = self._open(entry["shard"])
            out.append({"id": entry["id"], "index": i,
                        "input_ids": f.get_tensor(f"{i}.input_ids").tolist(),
                        "loss_mask": f.get_tensor(f"{i}.loss_mask").bool().tolist()})
        return out

    def __call__(self, samples, input_ids: torch.Tensor) -> torch.Tensor:
        return self._padded(samples, input_ids.shape[1], "features", self.dtype)

    def with_top(self, samples, input_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(features, (log-probabilities, token ids) of the target's k most likely next tokens, each (b, S, k), k at
        most top_k: the trainer checks it at start-up). Padding positions carry log-probability -inf (they are never
        supervised)."""
        s = input_ids.shape[1]
        logp = self._padded(samples, s, "top_logprobs", torch.float32, fill=float("-inf"))
        top = (logp, self._padded(samples, s, "top_ids", torch.long))
        return self(samples, input_ids), tuple(x[..., :k] for x in top)

    def _padded(self, samples, s: int, name: str, dtype: torch.dtype | None, fill: float = 0.0) -> torch.Tensor:
        """One cached tensor of every sample, right-padded to s positions: (b, s, ...)."""
        parts = [self._open(self.index["samples"][x["index"]]["shard"]).get_tensor(f"{x['index']}.{name}")
                 for x in samples]
        out = torch.full((len(parts), s, *parts[0].shape[1:]), fill, dtype=dtype or parts[0].dtype)
        for i, f in enumerate(parts):
            n = min(f.shape[0], s)
            out[i, :n] = f[:n]
        return out.to(self.device)

    def close(self) -> None:
        self._files.clear()


def write_feature_cache(model, samples: list[dict], layer_ids: list[int], out: str | os.PathLike, *,
                        shard_bytes: int = 1 << 30, dtype: torch.dtype = torch.bfloat16, device="cpu",
                        target: str = "", top_k: int = 0, log=print) -> Path:
    """Run the target once over every sample and write features + ids + loss mask as sharded safetensors; with
    `top_k`, also the log-probabilities (float16) and ids (int32) of the target's top_k next tokens at every position.
    Each shard and the index are written atomically; the index goes last, so a directory without it is an
    interrupted run."""
    from safetensors.torch import save_file

    from dflash.core.io import atomic_path, atomic_write_text

    out = Path(out)
    hidden = model.get_input_embeddings().weight.shape[1]
    feature_bytes = torch.tensor([], dtype=dtype).element_size()
    per_token = len(layer_ids) * hidden * feature_bytes + top_k * (2 + 4)  # + float16 log-probability, int32 id
    tokens = sum(len(x["input_ids"]) for x in samples)
    log(f"cache-features: {len(samples)} samples, {tokens} tokens x ({len(layer_ids)} layers x {hidden} "
        f"x {feature_bytes} bytes + top {top_k}) = about {tokens * per_token / 2**30:.2f} GiB on disk")
    lm_head = model.get_output_embeddings()
    capture = LayerCapture(model, layer_ids)
    entries, size, k = [], 0, 0
    shard: dict[str, torch.Tensor] = {}

    def flush():
        nonlocal shard, size, k
        if shard:
            name = f"features-{k:05d}.safetensors"
            with atomic_path(out / name) as tmp:
                save_file(shard, str(tmp))
            k, shard, size = k + 1, {}, 0

    try:
        for i, x in enumerate(samples):
            ids = torch.tensor([x["input_ids"]], device=device)
            feats, final = target_features(model, capture, ids, final=True)
            row = {"features": feats[0].to(dtype).cpu().contiguous(),
                   "input_ids": torch.tensor(x["input_ids"], dtype=torch.int64),
                   "loss_mask": torch.tensor(x["loss_mask"], dtype=torch.uint8)}
            if top_k:
                logp, top = lm_head(final[0]).float().log_softmax(-1).topk(top_k, dim=-1)
                row["top_logprobs"] = logp.to(torch.float16).cpu().contiguous()
                row["top_ids"] = top.to(torch.int32).cpu().contiguous()
            shard.update({f"{i}.{name}": t for name, t in row.items()})
            entries.append({"id": x.get("id", f"row-{i}"), "shard": f"features-{k:05d}.safetensors",
                            "length": len(x["input_ids"])})
            size += sum(t.numel() * t.element_size() for t in row.values())
            if size >= shard_bytes:
                flush()
        flush()
    finally:
        capture.remove()
    index = {"target": str(target), "target_layer_ids": list(layer_ids), "hidden_size": hidden,
             "dtype": str(dtype).removeprefix("torch."), "top_k": top_k, "samples": entries}
    atomic_write_text(out / INDEX_NAME, json.dumps(index) + "\n")
    return out
