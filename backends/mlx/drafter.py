"""The DFlash drafter as an mlx.nn.Module, and its context cache (mirrors backends/torch/drafter.py).

A few Qwen3 decoder layers without embedding or LM head (the target's are shared). In every layer the keys and
values are [proj(context) ; proj(block)] along the sequence axis and the queries come from the block only; attention
is not causal. Context = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from dflash.converters.checkpoint import validate_weights
from dflash.errors import DFlashError
from dflash.spec import DraftSpec


class DraftAttention(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.scale = spec.head_dim ** -0.5
        h, hd, bias = spec.hidden_size, spec.head_dim, spec.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)

    def context_kv(self, ctx: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """K/V (b, kv_heads, n, head_dim) of projected context (or block) entries at positions offset.."""
        b, n, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).reshape(b, n, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(ctx).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x, ctx, rope, start: int, cache: "DraftCache", layer: int) -> mx.array:
        b, t, _ = x.shape
        n = ctx.shape[1]
        # keys/values: context first, then the block, at contiguous absolute positions start..start+n+t-1
        k, v = self.context_kv(mx.concatenate([ctx, x], axis=1), rope, start)
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start + n)
        k, v, mask = cache.write(layer, k, v, t)  # mask: None (not causal, no sliding window) or boolean
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.self_attn = DraftAttention(spec)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def __call__(self, x, ctx, rope, start, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, start, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        self.layers = [DraftLayer(spec) for _ in range(spec.num_hidden_layers)]
        self.fc = nn.Linear(spec.hidden_size * spec.num_context_layers, spec.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        # one rope for all layers (no parameters); the checkpoint's rope_scaling is honoured as mlx-lm reads it
        self.rope = initialize_rope(spec.head_dim, base=spec.rope_theta, traditional=False,
                                    scaling_config=spec.rope_scaling,
                                    max_position_embeddings=spec.max_position_embeddings)

    def project_context(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))

    def step(self, block: mx.array, features: mx.array, cache: "DraftCache") -> mx.array:
        """One draft forward: append `features` (b, n, K*H) of the next n context positions to the cache, run the
        embedded block (b, B, H) that follows them, and return its final-normed states. The block's K/V is written
        past the cache end and forgotten."""
        n, bsz = features.shape[1], block.shape[1]
        start = cache.position
        cache.reserve(n + bsz)
        # (quantized matmuls must not see an empty input: no new context, no projection)
        ctx = self.project_context(features) if n else mx.zeros((block.shape[0], 0, block.shape[2]), block.dtype)
        x = block
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, self.rope, start, cache, i)
        cache.advance(n)
        return self.norm(x)

    def extend_context(self, features: mx.array, cache: "DraftCache") -> None:
        """Append context K/V without drafting (prefill). Context K/V depends only on the features, not on the
        block or on earlier layers' outputs, so a long prompt is absorbed chunk by chunk with projections alone."""
        n = features.shape[1]
        if n == 0:
            return
        cache.reserve(n)
        ctx = self.project_context(features)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(ctx, self.rope, cache.position)
            cache.write(i, k, v, 0)
        cache.advance(n)


class DraftCache:
    """Preallocated per-layer K/V of the drafter's context, same semantics as the torch DraftCache: grows by
    doubling; with a window W it keeps only the last W context entries (moved to the front when the buffer fills).
    Positions are baked into the keys by RoPE, so moving entries does not change what attention computes.
    Sliding-window layers attend as in the torch DraftCache (z-lab's rule: slot j sees positions within S of its own,
    causally inside the block unless the config sets `is_causal`)."""

    def __init__(self, spec: DraftSpec, dtype, batch: int = 1, capacity: int = 512, window: int | None = None):
        self.spec, self.window = spec, window
        self.sliding = [spec.window_for_layer(i) for i in range(spec.num_hidden_layers)]
        self.causal = [spec.causal_for_layer(i) for i in range(spec.num_hidden_layers)]
        shape = (batch, spec.num_key_value_heads, capacity, spec.head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(spec.num_hidden_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(spec.num_hidden_layers)]
        self.length = 0  # valid context entries in the buffer
        self.position = 0  # absolute position of the next context entry

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def reserve(self, n: int) -> None:
        if self.window is not None and self.length + n > self.capacity and self.length > self.window:
            lo, keep = self.length - self.window, self.window
            for buf in (self.k, self.v):
                for i, a in enumerate(buf):
                    buf[i] = mx.concatenate([a[:, :, lo:self.length], mx.zeros_like(a[:, :, keep:])], axis=2)
            self.length = keep
        if self.length + n > self.capacity:
            size = max(self.length + n, 2 * self.capacity)
            for buf in (self.k, self.v):
                for i, a in enumerate(buf):
                    pad = mx.zeros((*a.shape[:2], size - a.shape[2], a.shape[3]), dtype=a.dtype)
                    buf[i] = mx.concatenate([a, pad], axis=2)

    def write(self, layer: int, k: mx.array, v: mx.array, block: int):
        """Store new context + block K/V after the valid entries; return the span this layer attends to and its
        boolean mask (None: the whole span, for every block slot)."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        # the last `window` context positions before the anchor (all without one); a sliding layer's first slot
        # sees the last S-1 (later slots fewer, by the mask)
        sliding, causal = self.sliding[layer], self.causal[layer]
        lo = 0 if self.window is None else max(0, end - block - self.window)
        if sliding is not None:
            lo = max(lo, end - block - (sliding - 1))
        mask = None
        if block and (sliding is not None or causal):
            n_ctx = end - block - lo
            q = mx.arange(n_ctx, n_ctx + block)[:, None]
            p = mx.arange(n_ctx + block)[None, :]
            mask = mx.ones((block, n_ctx + block), dtype=mx.bool_)
            if causal:
                mask = mask & (p <= q)
            if sliding is not None:
                mask = mask & (q - p < sliding)
                if not causal:
                    mask = mask & (p - q < sliding)
        return self.k[layer][:, :, lo:end], self.v[layer][:, :, lo:end], mask

    def advance(self, n: int) -> None:
        self.length += n
        self.position += n

    def crop(self, position: int) -> bool:
        """Forget context from absolute `position` on. False if that needs entries the window already dropped."""
        drop = self.position - position
        if drop <= 0:
            return True
        if drop > self.length:
            return False
        self.length -= drop
        self.position = position
        return True

    def reset(self) -> None:
        self.length = self.position = 0

    def state(self) -> list[mx.array]:
        return self.k + self.v


def quantization_of(spec: DraftSpec) -> dict | None:
    """The MLX quantization recorded in config.json by `dflash.convert quantize` (mlx-lm's key), or None."""
    q = spec.extra.get("quantization")
    if q is None:
        return None
    if not isinstance(q, dict) or not all(isinstance(q.get(k), int) for k in ("group_size", "bits")):
        raise DFlashError(f"config.json: field 'quantization' must be an object with integer group_size and bits, "
                          f"got {q!r}")
    return q


def load_drafter(directory: str | os.PathLike, dtype=mx.float32, spec: DraftSpec | None = None) -> DFlashDrafter:
    """Strictly validated load: missing, unexpected or mis-shaped weights are a DFlashError, never random init."""
    spec = spec or DraftSpec.load(directory)
    quant = quantization_of(spec)
    files = validate_weights(spec, directory, allow_quantized=True)
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise DFlashError(f"{f}: cannot read safetensors ({str(e).splitlines()[0]})") from None
    model = DFlashDrafter(spec)
    if quant is not None:
        # mlx-lm's rule: a Linear is quantized exactly when the checkpoint has its scales
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"),
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and f"{p}.scales" in weights)
    # float weights take the run's dtype; packed quantized weights stay uint32 (their scales follow the dtype)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(f"{Path(directory)}: {str(e).splitlines()[0]}") from None
    model.eval()
    mx.eval(model.parameters())
    return model
