"""The DFlash drafter as a torch nn.Module, and its context cache.

A few Qwen3 decoder layers without embedding or LM head (the target's are shared). In every layer the keys and
values are [proj(context) ; proj(block)] along the sequence axis and the queries come from the block only; attention
is not causal. Context = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.converters.checkpoint import validate_weights
from dflash.errors import DFlashError
from dflash.spec import WEIGHTS_NAME, DraftSpec


def qwen3_config(spec: DraftSpec) -> Qwen3Config:
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        rope.update(spec.rope_scaling)
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return Qwen3Config(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers, intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, vocab_size=spec.vocab_size, rms_norm_eps=spec.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=spec.max_position_embeddings, attention_bias=spec.attention_bias, hidden_act="silu")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = hd = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attend):
        b, t, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)  # keys/values: context first, then the block
        s = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, *rope_q), rotate(k, *rope_kv)
        out = attend(self.layer_idx, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attend):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        config = qwen3_config(spec)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(spec.num_hidden_layers))
        self.fc = nn.Linear(spec.hidden_size * spec.num_context_layers, spec.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for absolute positions, shaped to broadcast over (batch, heads, seq, head_dim)."""
        cos, sin = self.rotary(like, positions if positions.dim() == 2 else positions[None])
        return cos[:, None], sin[:, None]

    def rope_range(self, start: int, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions start..start+length-1 from a table that grows by doubling (no per-cycle work)."""
        end = start + length
        table = self._rope_table
        if table is None or table[0].shape[2] < end or table[0].dtype != like.dtype or table[0].device != like.device:
            size = max(end, 2 * (table[0].shape[2] if table is not None else 1024))
            table = self.rope(torch.arange(size, device=like.device), like)
            self._rope_table = table
        return table[0][:, :, start:end], table[1][:, :, start:end]

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_kv, attend) -> torch.Tensor:
        """x: embedded block (b, T, H); ctx: projected context (b, S, H). Returns final-normed block states."""
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attend)
        return self.norm(x)

    # ---- inference ---------------------------------------------------------------------------------------------
    def step(self, block: torch.Tensor, features: torch.Tensor, cache: "DraftCache") -> torch.Tensor:
        """One draft forward: append `features` (b, n, K*H) of the next n context positions to the cache, run the
        embedded block (b, B, H) that follows them, and return its final-normed states. The block's K/V is written
        past the cache end and forgotten (crop after each draft forward)."""
        n, bsz = features.shape[1], block.shape[1]
        start = cache.position
        cache.reserve(n + bsz)
        ctx = self.project_context(features)
        rope_kv = self.rope_range(start, n + bsz, block)
        rope_q = (rope_kv[0][:, :, n:], rope_kv[1][:, :, n:])

        def attend(i, q, k, v):
            k, v, mask = cache.write(i, k, v, bsz)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        out = self(block, ctx, rope_q, rope_kv, attend)
        cache.advance(n)
        return out


class StaticDraftCache:
    """The drafter's context in one fixed-capacity buffer, for a compiled draft forward with fixed shapes (the CUDA
    graph path): new context is padded to the block size, written at a device-side offset, and attention spans the
    whole buffer under a mask. Slot i holds absolute position i; entries past the valid context (a previous block's
    K/V, padding) are masked until overwritten. No window: capacity bounds the context."""

    def __init__(self, spec: DraftSpec, dtype: torch.dtype, device, capacity: int):
        shape = (spec.num_hidden_layers, 1, spec.num_key_value_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.position = 0  # valid context entries = absolute position of the next one (host-side)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, n: int) -> None:
        if self.position + n > self.capacity:
            raise DFlashError(f"context: {self.position + n} positions exceed the static draft cache "
                              f"({self.capacity}); raise cache_len")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, block: int) -> None:
        """Store context K/V at the next positions (prefill; drafting writes inside static_draft)."""
        end = self.position + k.shape[2]
        self.k[layer, :, :, self.position:end] = k
        self.v[layer, :, :, self.position:end] = v

    def advance(self, n: int) -> None:
        self.position += n

    def crop(self, position: int) -> bool:
        self.position = min(self.position, position)
        return True

    def reset(self) -> None:
        self.position = 0


def static_draft(model: "DFlashDrafter", block: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
                 n: torch.Tensor, cache: StaticDraftCache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One draft forward at fixed shapes (compile it once): `features` (1, B, K*H) holds the n new context
    positions padded to B, written at slots start..; the embedded block (1, B, H) goes at start + n.., over the
    padding. `start` and `n` are 0-d device tensors and cos/sin the RoPE table of every slot, so nothing here
    depends on a host value."""
    b = block.shape[1]
    k_cache, v_cache = cache.k, cache.v
    arange = torch.arange(b, device=block.device)
    ctx_slots, block_slots = start + arange, start + n + arange
    slots = torch.cat([ctx_slots, block_slots])
    rope_kv = (cos[:, :, slots], sin[:, :, slots])
    rope_q = (rope_kv[0][:, :, b:], rope_kv[1][:, :, b:])
    mask = (torch.arange(k_cache.shape[3], device=block.device) < start + n + b)[None, None, None]

    def attend(i, q, k, v):
        k_cache[i].index_copy_(2, ctx_slots, k[:, :, :b])
        k_cache[i].index_copy_(2, block_slots, k[:, :, b:])  # after the context: it overwrites the padding
        v_cache[i].index_copy_(2, ctx_slots, v[:, :, :b])
        v_cache[i].index_copy_(2, block_slots, v[:, :, b:])
        return F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=mask, enable_gqa=True)

    return model(block, model.project_context(features), rope_q, rope_kv, attend)


class DraftCache:
    """Preallocated per-layer K/V of the drafter's context. Grows by doubling; with a window W it keeps only the
    last W context entries (moved to the front when the buffer fills), so memory stays bounded. Positions are
    baked into the keys by RoPE, so moving entries does not change what attention computes.

    Layers the checkpoint declares `sliding_attention` (window S) attend as z-lab's reference drafters do: the
    query at block slot j (position p_j) sees the keys at positions p with p_j - p < S, and, when the layer is
    causal (`DraftSpec.causal_for_layer`: sliding layers unless the config sets `is_causal`), no later block slot."""

    def __init__(self, spec: DraftSpec, dtype: torch.dtype, device, batch: int = 1, capacity: int = 512,
                 window: int | None = None):
        self.spec, self.window = spec, window
        self.sliding = [spec.window_for_layer(i) for i in range(spec.num_hidden_layers)]
        self.causal = [spec.causal_for_layer(i) for i in range(spec.num_hidden_layers)]
        self._masks: dict[tuple, torch.Tensor] = {}
        shape = (spec.num_hidden_layers, batch, spec.num_key_value_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # valid context entries in the buffer
        self.position = 0  # absolute position of the next context entry

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, n: int) -> None:
        if self.window is not None and self.length + n > self.capacity and self.length > self.window:
            keep = self.window
            self.k[:, :, :, :keep] = self.k[:, :, :, self.length - keep:self.length].clone()
            self.v[:, :, :, :keep] = self.v[:, :, :, self.length - keep:self.length].clone()
            self.length = keep
        if self.length + n > self.capacity:
            size = max(self.length + n, 2 * self.capacity)
            grow = lambda t: torch.cat([t, t.new_zeros(*t.shape[:3], size - t.shape[3], t.shape[4])], dim=3)
            self.k, self.v = grow(self.k), grow(self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, block: int):
        """Store new context + block K/V after the valid entries; return the span this layer attends to and its
        boolean mask (None: the whole span, for every block slot)."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        # the block sees the last `window` context positions before its anchor (all of them without one); a
        # sliding layer's first slot sees the last S-1 (later slots fewer, by the mask)
        sliding, causal = self.sliding[layer], self.causal[layer]
        lo = 0 if self.window is None else max(0, end - block - self.window)
        if sliding is not None:
            lo = max(lo, end - block - (sliding - 1))
        mask = None
        if block and (sliding is not None or causal):
            mask = self._mask(end - block - lo, block, sliding, causal)
        return self.k[layer, :, :, lo:end], self.v[layer, :, :, lo:end], mask

    def _mask(self, n_ctx: int, block: int, sliding: int | None, causal: bool) -> torch.Tensor:
        key = (n_ctx, block, sliding, causal)
        mask = self._masks.get(key)
        if mask is None:
            q = torch.arange(n_ctx, n_ctx + block, device=self.k.device)[:, None]  # span-relative positions
            p = torch.arange(n_ctx + block, device=self.k.device)[None, :]
            mask = torch.ones(block, n_ctx + block, dtype=torch.bool, device=self.k.device)
            if causal:
                mask &= p <= q
            if sliding is not None:
                mask &= q - p < sliding
                if not causal:
                    mask &= p - q < sliding
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[key] = mask
        return mask

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


def load_drafter(directory: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu",
                 spec: DraftSpec | None = None) -> DFlashDrafter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    spec = spec or DraftSpec.load(directory)
    files = validate_weights(spec, directory)
    with torch.device("meta"):
        model = DFlashDrafter(spec)
    state = {}
    for f in files:
        try:
            state.update(load_file(f))
        except SafetensorError as e:
            raise DFlashError(f"{f}: cannot read safetensors ({e})") from None
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Qwen3RotaryEmbedding(qwen3_config(spec))  # buffers were on meta
    return model.to(device=device, dtype=dtype).eval()


def save_drafter(model: DFlashDrafter, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write the canonical checkpoint: config.json + model.safetensors, each atomically."""
    from safetensors.torch import save_file

    from dflash.io import atomic_path

    directory = Path(directory)
    state = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
             for k, v in model.state_dict().items()}
    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    model.spec.save(directory)
    return directory


def extend_context(model: DFlashDrafter, features: torch.Tensor, cache: DraftCache | StaticDraftCache) -> None:
    """Append context K/V without drafting (prefill). Context K/V depends only on the features, not on the block
    or on earlier layers' outputs, so a long prompt is absorbed chunk by chunk with projections alone."""
    n = features.shape[1]
    if n == 0:
        return
    cache.reserve(n)
    ctx = model.project_context(features)
    b = ctx.shape[0]
    cos, sin = model.rope_range(cache.position, n, ctx)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        k = attn.k_norm(attn.k_proj(ctx).view(b, n, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(ctx).view(b, n, -1, attn.head_dim).transpose(1, 2)
        cache.write(i, rotate(k, cos, sin), v, 0)
    cache.advance(n)
