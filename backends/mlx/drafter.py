"""The DFlash drafter as an mlx.nn.Module, and its context cache (mirrors backends/torch/drafter.py).

A few Qwen3 decoder layers without embedding or LM head (the target's are shared). In every layer the keys and
values are [proj(context) ; proj(block)] along the sequence axis and the queries come from the block only; attention
is not causal. Context = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)). DFlash2 drafters add the
dynamic convolutions around every sublayer and the candidate selector (see backends/torch/drafter.py). A drafter
with a draft vocabulary (dflash.core.draft_vocab) has its own LM head over those tokens and the d2t / t2d maps.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from dflash.core import rules
from dflash.core.model_files.checkpoint import validate_weights
from dflash.core.draft_vocab import check_maps
from dflash.core.errors import DFlashError
from dflash.core.spec import DraftSpec

from .ops import MLXOps


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

    def context_kv(self, ctx: mx.array, rope, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """K/V (b, kv_heads, n, head_dim) of projected context (or block) entries at positions offset.."""
        b, n, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).reshape(b, n, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(ctx).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x, ctx, rope, at: tuple, cache, layer: int, counts: list[int]) -> mx.array:
        """at = (the context's first position, the block's): ints, or arrays (rows,) when rows sit at different
        positions or a row's context is shorter than the batch's."""
        b, t, _ = x.shape
        ctx_at, block_at = at
        if ctx.shape[1] == 0:  # (a quantized matmul must not see an empty input)
            k, v = self.context_kv(x, rope, block_at)
        elif isinstance(ctx_at, int) and ctx_at + ctx.shape[1] == block_at:
            # keys/values: context first, then the block, at contiguous absolute positions
            k, v = self.context_kv(mx.concatenate([ctx, x], axis=1), rope, ctx_at)
        else:
            (kc, vc), (kb, vb) = self.context_kv(ctx, rope, ctx_at), self.context_kv(x, rope, block_at)
            k, v = mx.concatenate([kc, kb], axis=2), mx.concatenate([vc, vb], axis=2)
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=block_at)
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

    def __call__(self, x, ctx, rope, at, cache, layer, counts):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, at, cache, layer, counts)
        return x + self.mlp(self.post_attention_layernorm(x))


class DynamicConv(nn.Module):
    """DFlash2's convolution over the block axis around one sublayer: y_t[c] = sum_j (base_kernel[s, j, c] +
    delta_t[s, j, c // group]) * x_{t-j}[c], side 0 before the sublayer, side 1 after; one block per row, so taps
    never reach before the block's first position."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.groups = taps, hidden // group
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def convolve(self, x: mx.array, delta: mx.array, side: int) -> mx.array:
        """x (rows, T, H), delta (rows, T, taps, groups) -> (rows, T, H)."""
        b, t, h = x.shape
        grouped = x.reshape(b, t, self.groups, -1)
        out = mx.zeros_like(grouped)
        for j in range(self.taps):
            coefficient = self.base_kernel[side, j].reshape(self.groups, -1) + delta[:, :, j, :, None]
            shift = min(j, t)
            shifted = grouped if j == 0 else mx.concatenate(
                [mx.zeros((b, shift, *grouped.shape[2:]), dtype=x.dtype), grouped[:, :t - shift]], axis=1)
            out = out + coefficient * shifted
        return out.reshape(b, t, h)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        delta = self.kernel_projection(x).reshape(*x.shape[:2], 2, self.taps, self.groups)
        return self.convolve(x, delta[:, :, 0], 0), delta[:, :, 1]


class DFlash2Layer(DraftLayer):
    def __init__(self, spec: DraftSpec):
        super().__init__(spec)
        assert spec.conv_kernel_size and spec.conv_group_size  # (a DFlash2 spec has them: DraftSpec.validate)
        self.attention_conv = DynamicConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
        self.mlp_conv = DynamicConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)

    def __call__(self, x, ctx, rope, at, cache, layer, counts):
        inner, delta = self.attention_conv.prepare(self.input_layernorm(x))
        attended = self.self_attn(inner, ctx, rope, at, cache, layer, counts)
        x = x + self.attention_conv.convolve(attended, delta, 1)
        inner, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.convolve(self.mlp(inner), delta, 1)


class CandidateSelector(nn.Module):
    """S_t(a, b) = U_t(b) + <A[a] * (W h_t), B[b]> over the top-k candidates of every position (DFlash2)."""

    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.predecessor_codebook = mx.zeros((vocab, rank))
        self.successor_codebook = mx.zeros((vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def pair_scores(self, logits: mx.array, hidden: mx.array, anchor: mx.array, top_k: int):
        """logits (rows, P, V) float32, hidden (rows, P, H), anchor (rows, 1) -> candidates (rows, P, k) and
        scores (rows, P, k, k): [t, i, j] = S_t(i-th candidate of t-1, j-th of t); at t = 0 every i is the anchor."""
        unary, candidates = MLXOps.top_k(logits, top_k)
        rows = anchor.shape[0]
        predecessors = mx.concatenate([mx.broadcast_to(anchor[:, :, None], (rows, 1, top_k)), candidates[:, :-1]],
                                      axis=1)
        projected = self.hidden_projection(hidden).astype(mx.float32)
        query = self.predecessor_codebook[predecessors].astype(mx.float32) * projected[:, :, None]
        keys = self.successor_codebook[candidates].astype(mx.float32)
        return candidates, unary[:, :, None, :] + query @ keys.swapaxes(-1, -2)


def scale_logits(logits: mx.array, multiplier: float, softcap: float | None) -> mx.array:
    return rules.scale_logits(MLXOps, logits, multiplier, softcap)


def spread(logits: mx.array, target_ids: mx.array, vocab_size: int) -> mx.array:
    """Draft-vocabulary logits (..., D) over the target's vocabulary (..., V), -inf elsewhere (see the torch
    backend's spread)."""
    full = mx.full((*logits.shape[:-1], vocab_size), -mx.inf, dtype=logits.dtype)
    ids = mx.broadcast_to(target_ids, logits.shape)
    return mx.put_along_axis(full, ids, logits, axis=-1)


class DFlashDrafter(nn.Module):
    source = "draft"  # what errors about this drafter name: its directory, once loaded

    def __init__(self, spec: DraftSpec):
        super().__init__()
        spec.check_public("--backend mlx")  # the torch backend's ablation drafters have no MLX counterpart
        self.spec = spec
        if spec.is_dflash2:
            self.layers: list[DraftLayer] = [DFlash2Layer(spec) for _ in range(spec.num_hidden_layers)]
            assert spec.selector_rank
            self.candidate_selector = CandidateSelector(spec.hidden_size, spec.vocab_size, spec.selector_rank)
        else:
            self.layers = [DraftLayer(spec) for _ in range(spec.num_hidden_layers)]
        self.fc = nn.Linear(spec.hidden_size * spec.num_context_layers, spec.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if spec.has_draft_vocab:  # the names and dtypes speculators writes and vLLM reads
            self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab, bias=False)
            self.d2t = mx.zeros((spec.draft_vocab,), dtype=mx.int64)
            self.t2d = mx.zeros((spec.vocab_size,), dtype=mx.bool_)
        # one rope for all layers (no parameters); the checkpoint's rope_scaling is honoured as mlx-lm reads it
        self.rope = initialize_rope(spec.head_dim, base=spec.rope_theta, traditional=False,
                                    scaling_config=spec.rope_scaling,
                                    max_position_embeddings=spec.max_position_embeddings)

    def project_context(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))

    def target_ids(self) -> mx.array:
        """The target id of every draft id (draft vocabulary only): i + d2t[i]."""
        return mx.arange(self.spec.draft_vocab, dtype=mx.int64) + self.d2t.astype(mx.int64)


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
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
            assert isinstance(loaded, dict)  # (a .safetensors file: its tensors by name)
            weights.update(loaded)
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
    if spec.has_draft_vocab:
        d2t: list[int] = model.d2t.tolist()  # type: ignore[assignment]  # (1-D: mlx's stubs type every nesting)
        t2d: list[bool] = model.t2d.tolist()  # type: ignore[assignment]
        check_maps(d2t, t2d, spec.vocab_size, str(files[0]))
    return model
