"""Who attends to whom in the packed training forward, written once as a predicate and evaluated three ways.

The packed forward runs N blocks of B slots against one sequence of S context positions. The rule for one draft
layer is `draft_attends`: the inference rule of both backends (dflash.core.draft_context.draft_visible) on the packed
layout. A block query sees

  context keys  strictly before its anchor (the anchor's own features are unknown at inference), at most `window`
                of them (the draft context window inference runs with), and on a sliding layer only keys within
                `sliding` of the query's own position;
  block keys    of its own block only: all of them, or the earlier ones on a causal layer, within `sliding`.

`mask_rule` turns it into a FlexAttention mask_mod (CUDA), `dense_mask` into a boolean SDPA mask, and `SplitMask`
into the two dense pieces the CPU path scores (context before the anchor, own block), one softmax over both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.core.draft_context import draft_visible
from dflash.core.draft_context import layer_rules as inference_rules

_ANY_BLOCK = 1 << 30  # the caller keeps block keys inside the query's own block


@dataclass(frozen=True)
class LayerRule:
    """How one draft layer attends: `sliding` window (None: full attention), causal inside the block or not, and
    the draft context window (None: the whole context) that applies to every layer."""

    sliding: int | None = None
    causal: bool = False
    window: int | None = None


def layer_rules(spec, window: int | None = None) -> tuple[LayerRule, ...]:
    """The rule of every layer of a drafter, as its config declares it (`layer_types`, `sliding_window`,
    `is_causal`) and as the inference caches run it (dflash.core.draft_context.layer_rules)."""
    return tuple(LayerRule(r.sliding, r.causal, window) for r in inference_rules(spec))


def draft_attends(q_pos, k_pos, anchor, k_in_block, rule: LayerRule = LayerRule()):
    """May the block query at absolute position `q_pos` attend to the key at absolute position `k_pos`? `anchor` is
    the position of the query's block slot 0; `k_in_block` says whether the key is a slot of the query's own block
    (True) or a context position (False). Tensors (broadcast together) or plain ints.

    This is inference's rule, dflash.core.draft_context.draft_visible, plus what only the packed layout needs: a context
    key at or after the anchor is a later position of the same sequence, never visible."""
    q_pos, k_pos, anchor = (torch.as_tensor(x) for x in (q_pos, k_pos, anchor))
    k_in_block = torch.as_tensor(k_in_block, dtype=torch.bool)
    visible = draft_visible(q_pos, k_pos, anchor, _ANY_BLOCK, window=rule.window, sliding=rule.sliding,
                            causal=rule.causal)
    return visible & (k_in_block | (k_pos < anchor))


def mask_rule(anchors: torch.Tensor, seq_len: int, block_size: int, rule: LayerRule = LayerRule()):
    """The rule as a FlexAttention mask_mod over [context (S) ; all blocks (N*B)] keys; never across blocks."""

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size
        anchor = anchors[b, j]
        in_block = kv_idx >= seq_len
        same_block = (kv_idx - seq_len) // block_size == j
        k_pos = torch.where(in_block, anchor + (kv_idx - seq_len) % block_size, kv_idx)
        q_pos = anchor + q_idx % block_size
        return (~in_block | same_block) & draft_attends(q_pos, k_pos, anchor, in_block, rule)

    return mask_mod


def dense_mask(anchors: torch.Tensor, seq_len: int, block_size: int, rule: LayerRule = LayerRule()) -> torch.Tensor:
    """(b, 1, N*B, S + N*B) bool, True = attend."""
    b, n = anchors.shape
    q = torch.arange(n * block_size, device=anchors.device)[:, None]
    kv = torch.arange(seq_len + n * block_size, device=anchors.device)[None, :]
    mod = mask_rule(anchors, seq_len, block_size, rule)
    return torch.stack([mod(i, 0, q, kv) for i in range(b)])[:, None]


def flex_mask(anchors: torch.Tensor, seq_len: int, block_size: int, rule: LayerRule = LayerRule()):
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    return create_block_mask(mask_rule(anchors, seq_len, block_size, rule), B=b, H=None, Q_LEN=n * block_size,
                             KV_LEN=seq_len + n * block_size, device=anchors.device)


@dataclass(frozen=True)
class SplitMask:
    """The rule in two dense pieces, for devices without FlexAttention: every block against the context (cut at
    its anchor, and by the window) and every block against itself. A query scores S + B keys, not S + N*B."""

    anchors: torch.Tensor  # (b, N)
    seq_len: int
    block_size: int
    rule: LayerRule = LayerRule()

    def context_mask(self) -> torch.Tensor:
        """(b, N, B or 1, S): one row per slot only when the slots differ (a sliding layer)."""
        slots = self.block_size if self.rule.sliding is not None else 1
        anchor = self.anchors[:, :, None, None]
        q_pos = anchor + torch.arange(slots, device=anchor.device)[:, None]
        k_pos = torch.arange(self.seq_len, device=anchor.device)
        return draft_attends(q_pos, k_pos, anchor, False, self.rule)

    def block_mask(self) -> torch.Tensor | None:
        """(B, B), or None when every slot sees its whole block (the DFlash default)."""
        if not self.rule.causal and (self.rule.sliding is None or self.rule.sliding >= self.block_size):
            return None
        k = torch.arange(self.block_size, device=self.anchors.device)
        return draft_attends(k[:, None], k[None, :], 0, True, self.rule)


def split_attention(q, k, v, mask: SplitMask) -> torch.Tensor:
    """Softmax over [context keys the rule allows ; the query's own block], as one distribution."""
    b, h, t, d = q.shape
    s, bs = mask.seq_len, mask.block_size
    n = t // bs
    if k.shape[1] != h:  # grouped-query attention
        k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    scale = d ** -0.5
    ctx = (q @ k[:, :, :s].transpose(-1, -2)) * scale  # (b, h, t, S)
    ctx = ctx.view(b, h, n, bs, s).masked_fill(~mask.context_mask()[:, None], float("-inf"))
    qb, kb, vb = (x.reshape(b, h, n, bs, d) for x in (q, k[:, :, s:], v[:, :, s:]))
    own = (qb @ kb.transpose(-1, -2)) * scale  # (b, h, N, B, B)
    block = mask.block_mask()
    if block is not None:
        own = own.masked_fill(~block, float("-inf"))
    p = torch.softmax(torch.cat([ctx, own], -1).float(), -1).to(v.dtype)
    # never an empty row: slot k always sees itself
    return p[..., :s].reshape(b, h, t, s) @ v[:, :, :s] + (p[..., s:] @ vb).reshape(b, h, t, d)


def build_masks(anchors: torch.Tensor, seq_len: int, block_size: int, rules, kind: str):
    """One mask per layer (layers with the same rule share it). kind: split | dense | flex."""
    make = {"split": lambda r: SplitMask(anchors, seq_len, block_size, r),
            "dense": lambda r: dense_mask(anchors, seq_len, block_size, r),
            "flex": lambda r: flex_mask(anchors, seq_len, block_size, r)}[kind]
    made = {}
    for r in rules:
        if r not in made:
            made[r] = make(r)
    return [made[r] for r in rules]


def attention_fn(mask):
    """attend(layer, q, k, v) for a mask, or for a list of per-layer masks (build_masks)."""
    if isinstance(mask, (list, tuple)):
        per_layer = [attention_fn(m) for m in mask]
        return lambda i, q, k, v: per_layer[i](i, q, k, v)
    if isinstance(mask, torch.Tensor):
        return lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if isinstance(mask, SplitMask):
        return lambda i, q, k, v: split_attention(q, k, v, mask)
    from torch.nn.attention.flex_attention import flex_attention

    flex = _compiled_flex() if mask.kv_indices.is_cuda else flex_attention
    return lambda i, q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True)


_COMPILED_FLEX = None


def _compiled_flex():
    """One compiled flex_attention per process (compiling per call would recompile on every step)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX
