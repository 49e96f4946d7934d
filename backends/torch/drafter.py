"""The DFlash drafter as a torch nn.Module, and its context cache.

A few Qwen3 decoder layers without embedding or LM head (the target's are shared). In every layer the keys and
values are [proj(context) ; proj(block)] along the sequence axis and the queries come from the block only; attention
is not causal. Context = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)).

DFlash2 drafters (spec.is_dflash2) wrap each sublayer in a two-tap dynamic convolution over the block and choose
their proposals with a candidate selector (a walk over the top-k of every position, scored by token pairs).
The ablation modes of dflash.core.spec (`context_mode` none / input) run the same layers with an empty context; input
fusion adds a projected feature to the block's input embeddings instead (`fused`).
A drafter with a draft vocabulary (dflash.core.draft_vocab) has an LM head of its own over those tokens and the
d2t / t2d maps; its logits are spread over the target's vocabulary, -inf elsewhere (`spread`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.core import rules
from dflash.core.model_files.checkpoint import validate_weights
from dflash.core.draft_vocab import check_maps, vocab_maps
from dflash.core.errors import DFlashError
from dflash.core.spec import WEIGHTS_NAME, DraftSpec

from .ops import TorchOps


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
        assert hd and config.num_attention_heads and config.num_key_value_heads  # (qwen3_config sets them)
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

    def forward(self, x, ctx, rope_q, rope_kv, attend, block: int | None = None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DynamicConv(nn.Module):
    """DFlash2's convolution over the block axis around one sublayer. The normed input is projected once into
    per-token kernel deltas (2 sides x taps x channel groups); side s computes
    y_t[c] = sum_j (base_kernel[s, j, c] + delta_t[s, j, c // group]) * x_{t-j}[c], side 0 on the sublayer's input,
    side 1 on its output. x is one block per row: taps never reach before the block's first position."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.groups = taps, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block: int | None = None) -> torch.Tensor:
        """x (rows, T, H), delta (rows, T, taps, groups) -> (rows, T, H). `block`: the block length when x packs
        several blocks along T (training); the taps stay inside each."""
        b, t, h = x.shape
        if block is not None and t != block:
            blocks = self.convolve(x.reshape(-1, block, h), delta.reshape(-1, block, *delta.shape[2:]), side)
            return blocks.reshape(b, t, h)
        grouped = x.view(b, t, self.groups, -1)
        out = torch.zeros_like(grouped)
        for j in range(self.taps):
            coefficient = self.base_kernel[side, j].view(self.groups, -1) + delta[:, :, j, :, None]
            shifted = F.pad(grouped[:, :max(t - j, 0)], (0, 0, 0, 0, min(j, t), 0))  # x_{t-j}, zero before the block
            out = out + coefficient * shifted
        return out.reshape(b, t, h)

    def prepare(self, x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the deltas of side 1, for `convolve(sublayer output, delta, 1)`."""
        delta = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.groups)
        return self.convolve(x, delta[:, :, 0], 0, block), delta[:, :, 1]


class DFlash2Layer(DraftLayer):
    """A draft layer whose attention and MLP are each wrapped in a DynamicConv: h + conv1(sublayer(conv0(norm(h))))."""

    def __init__(self, config: Qwen3Config, layer_idx: int, spec: DraftSpec):
        super().__init__(config, layer_idx)
        assert spec.conv_kernel_size and spec.conv_group_size  # (a DFlash2 spec has them: DraftSpec.validate)
        self.attention_conv = DynamicConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
        self.mlp_conv = DynamicConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)

    def forward(self, x, ctx, rope_q, rope_kv, attend, block: int | None = None):
        inner, delta = self.attention_conv.prepare(self.input_layernorm(x), block)
        x = x + self.attention_conv.convolve(self.self_attn(inner, ctx, rope_q, rope_kv, attend), delta, 1, block)
        inner, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.convolve(self.mlp(inner), delta, 1, block)


class CandidateSelector(nn.Module):
    """DFlash2's proposal chooser. Per block position t the candidates are the top-k tokens of the draft logits
    (their logits the unary scores U_t); a pair scores S_t(a, b) = U_t(b) + <A[a] * (W h_t), B[b]>, a the token
    chosen at t-1 (the anchor at the first position)."""

    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def pair_scores(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, top_k: int):
        """logits (rows, P, V) float32, hidden (rows, P, H), anchor (rows, 1) -> candidates (rows, P, k) and
        scores (rows, P, k, k): [t, i, j] = S_t(i-th candidate of t-1, j-th of t); at t = 0 every i is the anchor.
        All pairs at once, so the walk that follows is gathers only."""
        unary, candidates = logits.topk(top_k, dim=-1)
        predecessors = torch.cat([anchor[:, :, None].expand(-1, 1, top_k), candidates[:, :-1]], dim=1)
        query = self.predecessor_codebook[predecessors].float() * self.hidden_projection(hidden).float()[:, :, None]
        keys = self.successor_codebook[candidates].float()
        return candidates, unary[:, :, None, :] + query @ keys.transpose(-1, -2)

    def score(self, logits: torch.Tensor, hidden: torch.Tensor, predecessors: torch.Tensor,
              candidates: torch.Tensor) -> torch.Tensor:
        """S(a, b) for given candidates only (training: one predecessor per row): logits (rows, V), hidden
        (rows, H), predecessors (rows,), candidates (rows, k) -> (rows, k); the entries of `pair_scores`."""
        query = self.predecessor_codebook[predecessors].float() * self.hidden_projection(hidden).float()
        pair = (self.successor_codebook[candidates].float() @ query[:, :, None])[..., 0]
        return logits.float().gather(-1, candidates) + pair


def scale_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    return rules.scale_logits(TorchOps, logits, multiplier, softcap)


def spread(logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits (..., D) as logits over the target's vocabulary (..., V): -inf off the draft
    vocabulary, so every distribution taken from them gives those tokens probability 0 (vLLM's compute_logits)."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, target_ids, logits)


class DFlashDrafter(nn.Module):
    source = "draft"  # what errors about this drafter name: its directory, once loaded
    d2t: torch.Tensor  # (draft vocabulary only: dflash.core.draft_vocab)
    t2d: torch.Tensor

    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        config = qwen3_config(spec)
        if spec.is_dflash2:
            self.layers = nn.ModuleList(DFlash2Layer(config, i, spec) for i in range(spec.num_hidden_layers))
            assert spec.selector_rank
            self.candidate_selector = CandidateSelector(spec.hidden_size, spec.vocab_size, spec.selector_rank)
        else:
            self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(spec.num_hidden_layers))
        if spec.uses_target_features:
            self.fc = nn.Linear(spec.hidden_size * spec.num_context_layers, spec.hidden_size, bias=False)
            self.hidden_norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if spec.has_draft_vocab:  # the names and dtypes speculators writes and vLLM reads
            self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))
        self.rotary = Qwen3RotaryEmbedding(config)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft id (draft vocabulary only): i + d2t[i]."""
        return torch.arange(self.spec.draft_vocab, device=self.d2t.device) + self.d2t.long()

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
                fused: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
        """x: embedded block (b, T, H); ctx: projected context (b, S, H), empty for the ablation modes; fused
        (b, T, H): input fusion's projected feature per slot, added to the embeddings; block: the block length
        when x packs T / block blocks (training; DFlash2's convolutions stay inside each). Returns final-normed
        block states."""
        if fused is not None:
            x = x + fused.to(x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, attend, block=block)
        return self.norm(x)


def load_drafter(directory: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device="cpu",
                 spec: DraftSpec | None = None) -> DFlashDrafter:
    """The drafter in `directory`, strictly validated, its floating weights in `dtype` (None: as stored)."""
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
    if spec.has_draft_vocab:
        check_maps(model.d2t.tolist(), model.t2d.tolist(), spec.vocab_size, str(files[0]))
    return model.to(device=device, dtype=dtype).eval()


def with_draft_vocab(drafter: DFlashDrafter, token_ids: list[int], head: torch.Tensor) -> DFlashDrafter:
    """The drafter with the draft vocabulary `token_ids` (ascending target ids, dflash.core.draft_vocab): the same
    layers, and an LM head of the target head's rows `head[token_ids]` in the head's own dtype, so its logits are
    the target head's, restricted. A vocabulary as large as the target's is none (no head, no maps)."""
    spec = dataclasses.replace(drafter.spec, draft_vocab_size=len(token_ids))
    spec.check("--draft-vocab")
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    if spec.has_draft_vocab:
        d2t, t2d = vocab_maps(token_ids, spec.vocab_size)
        ids = torch.tensor(token_ids, device=head.device)
        state.update({"lm_head.weight": head.detach()[ids].clone(), "d2t": torch.tensor(d2t, dtype=torch.long),
                      "t2d": torch.tensor(t2d, dtype=torch.bool)})
    with torch.device("meta"):
        model = DFlashDrafter(spec)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Qwen3RotaryEmbedding(qwen3_config(spec))
    return model.train(drafter.training)


def save_drafter(model: DFlashDrafter, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write the canonical checkpoint: config.json + model.safetensors, each atomically."""
    from safetensors.torch import save_file

    from dflash.core.io import atomic_path

    directory = Path(directory)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in model.state_dict().items()}  # the draft vocabulary's maps keep their integer dtypes
    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    model.spec.save(directory)
    return directory
