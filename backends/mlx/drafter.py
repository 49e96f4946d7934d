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

from dflash.checkpoint import validate_weights
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

    def __call__(self, x, ctx, rope, start: int, cache, layer: int, counts: list[int]) -> mx.array:
        b, t, _ = x.shape
        n = ctx.shape[1]
        # keys/values: context first, then the block, at contiguous absolute positions start..start+n+t-1
        k, v = self.context_kv(mx.concatenate([ctx, x], axis=1), rope, start)
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start + n)
        k, v, mask = cache.write(layer, k, v, counts, t)  # mask: None (not causal, no sliding window) or boolean
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

    def __call__(self, x, ctx, rope, start, cache, layer, counts):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, start, cache, layer, counts)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        spec.check_public("--backend mlx")  # the torch backend's ablation drafters have no MLX counterpart
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
    model.source = str(directory)  # what errors about this drafter name
    return model
