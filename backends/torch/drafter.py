"""The DFlash drafter as a torch nn.Module, and its context cache.

A few Qwen3 decoder layers without embedding or LM head (the target's are shared). In every layer the keys and
values are [proj(context) ; proj(block)] along the sequence axis and the queries come from the block only; attention
is not causal. Context = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)).
The ablation modes of dflash.spec (`context_mode` none / input) run the same layers with an empty context; input
fusion adds a projected feature to the block's input embeddings instead (`fused`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.checkpoint import validate_weights
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
        if spec.uses_target_features:
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

    def fused_input(self, projected: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
        """Input fusion (context_mode input): for every slot of the block at each anchor, the projected feature of
        the position before it, the last context position (zero for an anchor at 0, which has no context).
        projected (b, S, H) by position, anchors (b, N) -> (b, N * block, H)."""
        prev = (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, projected.shape[-1])
        feature = projected.gather(1, prev) * (anchors > 0)[..., None].to(projected.dtype)
        return feature.repeat_interleave(block, dim=1)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_kv, attend,
                fused: torch.Tensor | None = None) -> torch.Tensor:
        """x: embedded block (b, T, H); ctx: projected context (b, S, H), empty for the ablation modes; fused
        (b, T, H): input fusion's projected feature per slot, added to the embeddings. Returns final-normed block
        states."""
        if fused is not None:
            x = x + fused.to(x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attend)
        return self.norm(x)


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
    model.source = str(directory)  # what errors about this drafter name
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
