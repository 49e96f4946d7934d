"""Exact rewinding of mlx-lm caches that keep bounded state (mirrors backends/torch/rewind.py).

mlx-lm's `trim_prompt_cache` refuses these caches, and speculative decoding must drop the rejected part of every
verified block:

- `ArraysCache` of a Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE): [conv window, recurrent state]. The layer rebinds
  both entries each forward (MLX arrays are values), so the pre-forward pair is a free snapshot. During the forward
  the outputs of `in_proj_qkv`, `in_proj_a` and `in_proj_b` are recorded by taps put into this model instance's
  GatedDeltaNet modules for the duration of the call (nothing is patched for the process). Keeping the first k
  positions re-runs the layer's own conv + `normalize_qk` + `gated_delta_update` (the same functions from the layer's
  module) on those k recorded positions from the snapshot: each position's inputs depend only on itself and earlier
  positions, so the result is the state after exactly the accepted tokens, built from the values the verify forward
  computed. No projection is re-run.
- `RotatingKVCache` of a sliding-window layer (gpt-oss): once it has wrapped, `trim` is refused. A multi-token
  forward leaves it in temporal order ([last W-1 old entries ; the T new ones], `_idx` at the end), so keeping k of
  the T is slicing k off that buffer, which is exactly the state a forward of those k tokens would have left. Keeping
  none restores the pre-forward copy (taken before each forward, because a one-token forward writes in place).
- `KVCache` (full attention): the library's own `trim`.

Rewinds reach at most back to the start of the last forward (any number of them, each from the post-forward state);
`rewind` returns False beyond that, and the backend starts over from an empty cache.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from dflash.core.errors import DFlashError

_LINEAR_ATTRS = ("in_proj_qkv", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "conv_kernel_size",
                 "key_dim", "value_dim", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def needs_rewind(cache: list) -> bool:
    return any(isinstance(c, (ArraysCache, RotatingKVCache)) for c in cache)


class _Record:
    """Stands in for one projection of one layer during a forward and keeps its output."""

    def __init__(self, module, store: dict, key: str):
        self.module, self.store, self.key = module, store, key

    def __call__(self, x):
        out = self.module(x)
        self.store[self.key] = out
        return out


class MLXRewind:
    def __init__(self, layers: list, cache: list):
        self.linear: dict[int, nn.Module] = {}
        for i, c in enumerate(cache):
            if isinstance(c, KVCache) or isinstance(c, RotatingKVCache):
                continue
            mixer = _get(layers[i], "linear_attn")
            lib = sys.modules.get(type(mixer).__module__) if mixer is not None else None
            if (not isinstance(c, ArraysCache) or mixer is None or any(_get(mixer, a) is None for a in _LINEAR_ATTRS)
                    or not hasattr(lib, "gated_delta_update") or not hasattr(lib, "normalize_qk")):
                raise DFlashError(f"layer {i}: an mlx-lm cache ({type(c).__name__}) this backend cannot rewind; "
                                  "speculative decoding needs an exact rollback of every layer")
            self.linear[i] = mixer
        self.recorded: dict[int, dict] = {i: {} for i in self.linear}
        self.cache = cache
        self.snapshot: dict[int, tuple] = {}
        self.post: dict[int, tuple] = {}
        self.length = 0  # positions of the last forward
        self.kept = 0  # of which still cached
        self.started = False

    def attach(self, cache: list) -> None:
        self.cache, self.snapshot, self.post, self.started = cache, {}, {}, False

    @contextmanager
    def recording(self):
        """Taps on the projections of this model's GatedDeltaNet modules, for one forward."""
        for i, mixer in self.linear.items():
            for name in ("qkv", "a", "b"):
                mixer[f"in_proj_{name}"] = _Record(mixer[f"in_proj_{name}"], self.recorded[i], name)
        try:
            yield
        finally:
            for mixer in self.linear.values():
                for name in ("qkv", "a", "b"):
                    tap = mixer[f"in_proj_{name}"]
                    if isinstance(tap, _Record):
                        mixer[f"in_proj_{name}"] = tap.module

    # ---- around each target forward -------------------------------------------------------------------------------
    def before_forward(self) -> None:
        for i, c in enumerate(self.cache):
            if isinstance(c, ArraysCache):
                self.snapshot[i] = (c[0], c[1])  # rebound, never written in place, by the layer
            elif isinstance(c, RotatingKVCache):
                # a one-token forward writes into the buffer in place: keep a copy of the arrays
                keys = None if c.keys is None else mx.array(c.keys)
                values = None if c.values is None else mx.array(c.values)
                self.snapshot[i] = (keys, values, c.offset, c._idx)

    def after_forward(self, length: int) -> None:
        self.length = self.kept = length
        self.started = True
        self.post = {i: (c.keys, c.values, c.offset, c._idx) for i, c in enumerate(self.cache)
                     if isinstance(c, RotatingKVCache)}

    # ---- rewinding ------------------------------------------------------------------------------------------------
    def rewind(self, n: int) -> bool:
        """Forget the last n cached positions: True when done exactly, False (nothing changed) when that reaches
        past the start of the last forward."""
        if n <= 0:
            return n == 0
        keep = self.kept - n
        if not self.started or keep < 0:
            return False
        drop = self.length - keep
        for i, c in enumerate(self.cache):
            if isinstance(c, KVCache):
                c.trim(n)
            elif isinstance(c, RotatingKVCache):
                self._rewind_rotating(c, i, keep, drop)
            elif isinstance(c, ArraysCache):
                self._rewind_linear(c, i, keep)
        self.kept = keep
        return True

    def _rewind_rotating(self, c: RotatingKVCache, i: int, keep: int, drop: int) -> None:
        if keep == 0:
            c.keys, c.values, c.offset, c._idx = self.snapshot[i]
            return
        keys, values, offset, idx = self.post[i]
        if self.length == 1 or idx != keys.shape[2]:
            raise AssertionError("a rotating cache is rewound only inside a multi-token forward")
        c.keys, c.values = keys[..., : idx - drop, :], values[..., : idx - drop, :]
        c.offset, c._idx = offset - drop, idx - drop

    def _rewind_linear(self, c: ArraysCache, i: int, keep: int) -> None:
        conv0, state0 = self.snapshot[i]
        if keep == 0:
            c[0], c[1] = conv0, state0
            return
        mixer, rec = self.linear[i], self.recorded[i]
        lib = sys.modules[type(mixer).__module__]
        qkv, a, b = rec["qkv"][:, :keep], rec["a"][:, :keep], rec["b"][:, :keep]
        bsz = qkv.shape[0]
        if conv0 is None:
            conv0 = mx.zeros((bsz, mixer.conv_kernel_size - 1, mixer.conv_dim), dtype=qkv.dtype)
        # the layer's own steps for these positions: conv window, depthwise conv + silu, split, normalise, recur
        conv_input = mx.concatenate([conv0, qkv], axis=1)
        c[0] = mx.contiguous(conv_input[:, -(mixer.conv_kernel_size - 1):, :])
        conv_out = nn.silu(mixer.conv1d(conv_input))
        q, k, v = [t.reshape(bsz, keep, h, d) for t, h, d in zip(
            mx.split(conv_out, [mixer.key_dim, 2 * mixer.key_dim], -1),
            [mixer.num_k_heads, mixer.num_k_heads, mixer.num_v_heads],
            [mixer.head_k_dim, mixer.head_k_dim, mixer.head_v_dim])]
        q, k = lib.normalize_qk(q, k, inv_scale=mixer.head_k_dim ** -0.5, eps=1e-6)
        _, state = lib.gated_delta_update(q, k, v, a, b, mixer.A_log, mixer.dt_bias, state0, None,
                                          use_kernel=not mixer.training)
        c[1] = state


def _get(module, name):
    try:
        return module[name] if name in module else getattr(module, name, None)
    except TypeError:
        return getattr(module, name, None)
