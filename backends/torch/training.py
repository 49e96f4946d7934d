"""The DFlash training objective: random anchors, one packed forward for all blocks of a sequence, weighted CE.

For a sequence of S tokens with target features F (S, K*H) and anchors a_1..a_N:
  block j   = [x_{a_j}, MASK, ..., MASK] at positions a_j .. a_j+B-1; slot k (k >= 1) is labelled x_{a_j+k}
  attention = a query of block j sees context positions p < a_j (strictly: the anchor's own features are not
              known at inference time), every slot of block j (bidirectional), and nothing of other blocks
  loss      = sum_k w_k CE_k / sum_k w_k over supervised slots, w_k = exp(-(k-1)/gamma)
The same DFlashDrafter.forward runs here and at inference; only the attention mask differs, so a test can check that
the packed forward of every block equals the inference-time forward for that context and block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .drafter import DFlashDrafter

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, max(block_size / 2.0 - 1.0, 1.0))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """loss_mask (b, S) bool -> anchors (b, N) long and valid (b, N) bool. A position is a valid anchor when it and
    the next token are supervised. Rows with fewer valid positions are padded with anchor 0, valid=False (masked),
    so shapes stay static. Anchors are sorted (cheaper masks, nicer to read)."""
    b, s = loss_mask.shape
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    scores = torch.rand(b, s, generator=generator, device=loss_mask.device) if generator is None or \
        generator.device == loss_mask.device else torch.rand(b, s, generator=generator).to(loss_mask.device)
    scores = torch.where(ok, scores, torch.full_like(scores, -1.0))
    k = min(num_anchors, s)
    top, idx = scores.topk(k, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, idx, torch.zeros_like(idx))
    if k < num_anchors:
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(b, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(b, pad)], 1)
    # sort valid anchors first by position; padding last
    key = torch.where(valid, anchors, torch.full_like(anchors, s + 1))
    order = key.argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def build_blocks(input_ids, loss_mask, anchors, valid, block_size: int, mask_token_id: int, gamma: float):
    """-> block ids (b, N*B), positions (b, N*B), labels (b, N*B), weights (b, N*B) (0 = no loss)."""
    b, s = input_ids.shape
    k = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + k  # (b, N, B)
    inside = pos < s
    gather = pos.clamp(max=s - 1)
    labels = input_ids.gather(1, gather.flatten(1)).view_as(pos)
    supervised = loss_mask.gather(1, gather.flatten(1)).view_as(pos) & inside & valid[:, :, None] & (k > 0)
    ids = torch.full_like(pos, mask_token_id)
    ids[:, :, 0] = labels[:, :, 0]  # slot 0: the clean anchor token
    w = torch.exp(-(k.float() - 1).clamp(min=0) / gamma)
    weights = torch.where(supervised, w.expand_as(pos), torch.zeros((), device=w.device))
    return ids.flatten(1), pos.flatten(1), labels.flatten(1), weights.flatten(1)


def mask_rule(anchors: torch.Tensor, seq_len: int, block_size: int):
    """The attention rule as a FlexAttention mask_mod; the dense mask below evaluates the very same function."""

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size
        anchor = anchors[b, j]
        in_context = (kv_idx < seq_len) & (kv_idx < anchor)
        same_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == j)
        return in_context | same_block

    return mask_mod


def dense_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """(b, 1, N*B, S + N*B) bool, True = attend."""
    b, n = anchors.shape
    q = torch.arange(n * block_size, device=anchors.device)[:, None]
    kv = torch.arange(seq_len + n * block_size, device=anchors.device)[None, :]
    rule = mask_rule(anchors, seq_len, block_size)
    return torch.stack([rule(i, 0, q, kv) for i in range(b)])[:, None]


def flex_mask(anchors: torch.Tensor, seq_len: int, block_size: int):
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    return create_block_mask(mask_rule(anchors, seq_len, block_size), B=b, H=None, Q_LEN=n * block_size,
                             KV_LEN=seq_len + n * block_size, device=anchors.device)


@dataclass(frozen=True)
class SplitMask:
    """mask_rule computed in two dense pieces, for devices without FlexAttention: every block against the context
    (cut at its anchor) and every block against itself. A query scores S + B keys instead of S + N*B."""

    anchors: torch.Tensor  # (b, N)
    seq_len: int
    block_size: int


def split_attention(q, k, v, mask: SplitMask) -> torch.Tensor:
    """Softmax over [context keys before the anchor ; the query's own block], as one distribution."""
    b, h, t, d = q.shape
    s, bs = mask.seq_len, mask.block_size
    n = t // bs
    if k.shape[1] != h:  # grouped-query attention
        k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    scale = d ** -0.5
    ctx = (q @ k[:, :, :s].transpose(-1, -2)) * scale  # (b, h, t, S)
    before = torch.arange(s, device=q.device)[None, None, :] < mask.anchors[:, :, None]  # (b, N, S)
    ctx = ctx.view(b, h, n, bs, s).masked_fill(~before[:, None, :, None, :], float("-inf"))
    qb, kb, vb = (x.reshape(b, h, n, bs, d) for x in (q, k[:, :, s:], v[:, :, s:]))
    own = (qb @ kb.transpose(-1, -2)) * scale  # (b, h, N, B, B): bidirectional inside the block
    p = torch.softmax(torch.cat([ctx, own], -1).float(), -1).to(v.dtype)
    out = p[..., :s].reshape(b, h, t, s) @ v[:, :, :s] + (p[..., s:] @ vb).reshape(b, h, t, d)
    return out


def attention_fn(mask):
    """SDPA with a dense boolean mask, the split computation, or FlexAttention with a BlockMask."""
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


def packed_forward(drafter: DFlashDrafter, embed, features, block_ids, positions, mask):
    """Final-normed drafter states (b, N*B, H) for every block at once."""
    s = features.shape[1]
    x = embed(block_ids).to(features.dtype)
    ctx = drafter.project_context(features)
    ctx_pos = torch.arange(s, device=features.device).expand(features.shape[0], s)
    rope_q = drafter.rope(positions, x)
    rope_kv = drafter.rope(torch.cat([ctx_pos, positions], 1), x)
    return drafter(x, ctx, rope_q, rope_kv, attention_fn(mask))


def chunked_weighted_ce(hidden, lm_head, labels, weights, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * CE) and sum(w * correct) over rows with w > 0, the LM head applied chunk by chunk under activation
    checkpointing, so full-vocabulary logits never exist for all rows at once (nor are kept for backward)."""
    h = hidden.flatten(0, 1)
    y, w = labels.flatten(), weights.flatten()
    keep = w > 0
    h, y, w = h[keep], y[keep], w[keep]

    def piece(h_, y_, w_):
        logits = lm_head(h_).float()
        ce = F.cross_entropy(logits, y_, reduction="none")
        return (ce * w_).sum(), ((logits.argmax(-1) == y_).float() * w_).sum()

    loss = h.new_zeros((), dtype=torch.float32)
    correct = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        args = (h[i:i + chunk], y[i:i + chunk], w[i:i + chunk])
        l, c = checkpoint(piece, *args, use_reentrant=False) if torch.is_grad_enabled() else piece(*args)
        loss, correct = loss + l, correct + c
    return loss, correct


def block_loss_sum(drafter: DFlashDrafter, embed, lm_head, features, input_ids, loss_mask, anchors, valid, *,
                   block_size: int, mask_token_id: int, gamma: float | None = None, use_flex: bool | None = None,
                   forward=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised pieces of the loss for given anchors: (sum w*CE, sum w*correct, sum w). The trainer divides by
    the weight sum of the whole global batch, so the loss does not depend on how the batch is split across ranks
    and micro-batches. `forward(x, features, positions, mask)` replaces packed_forward (a DDP/FSDP wrapper)."""
    gamma = gamma or default_gamma(block_size)
    ids, pos, labels, weights = build_blocks(input_ids, loss_mask, anchors, valid, block_size, mask_token_id, gamma)
    s = input_ids.shape[1]
    use_flex = features.is_cuda if use_flex is None else use_flex
    mask = flex_mask(anchors, s, block_size) if use_flex else SplitMask(anchors, s, block_size)
    if forward is None:
        hidden = packed_forward(drafter, embed, features, ids, pos, mask)
    else:
        hidden = forward(embed(ids).to(features.dtype), features, pos, mask)
    loss_sum, correct = chunked_weighted_ce(hidden, lm_head, labels, weights)
    return loss_sum, correct, weights.sum()


def dflash_loss(drafter: DFlashDrafter, embed, lm_head, features, input_ids, loss_mask, *, block_size: int,
                num_anchors: int, mask_token_id: int, gamma: float | None = None, generator=None,
                use_flex: bool | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted-CE loss of one (padded) batch. features: target hidden states (b, S, K*H) at target_layer_ids."""
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    loss_sum, correct, wsum = block_loss_sum(drafter, embed, lm_head, features, input_ids, loss_mask, anchors, valid,
                                             block_size=block_size, mask_token_id=mask_token_id, gamma=gamma,
                                             use_flex=use_flex)
    loss = loss_sum / wsum.clamp(min=1e-6)
    return loss, {"weight": wsum.detach(), "accuracy": (correct / wsum.clamp(min=1e-6)).detach(),
                  "anchors": valid.sum().detach()}


@torch.no_grad()
def target_features(model, capture, input_ids, attention_mask=None) -> torch.Tensor:
    """Frozen target forward, keeping only the captured layers (no logits are computed)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return capture.pop()


def cosine_lr(step: int, total: int, lr: float, warmup_ratio: float = 0.04, min_ratio: float = 0.0) -> float:
    warm = max(1, int(round(total * warmup_ratio)))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
