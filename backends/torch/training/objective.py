"""The DFlash training objective: random anchors, one packed forward for all blocks of a sequence, weighted CE.

For a sequence of S tokens with target features F (S, K*H) and anchors a_1..a_N:
  block j   = [x_{a_j}, MASK, ..., MASK] at positions a_j .. a_j+B-1; slot k (k >= 1) is labelled x_{a_j+k}
  attention = a query of block j sees context positions p < a_j (strictly: the anchor's own features are not
              known at inference time), every slot of block j (bidirectional), and nothing of other blocks
  loss      = sum_k w_k CE_k / sum_k w_k over supervised slots, w_k = exp(-(k-1)/gamma)
With `kl_weight` a, each slot's CE is blended with a term against the target's full next-token distribution p at
that position (p optionally truncated to its top-k tokens: the same signal where the mass is, at a fraction of the
cost), the draft's being q:
  slot loss = (1 - a) CE(q, x_{a_j+k}) + a H(p, q)                  soft_loss "kl": same optimum as KL(p || q)
  slot loss = (1 - a) CE(q, x_{a_j+k}) - a log sum_x min(p(x), q(x))  soft_loss "lk": -log(1 - TV(p, q)), the log
                                                                     of the probability that a draft from q is
                                                                     accepted against p (speculators' LK loss)
A drafter with a draft vocabulary (dflash.core.draft_vocab) scores with its own head over those tokens, as the
field trains it: a slot whose label is outside the vocabulary carries no loss (EAGLE-3 masks those positions; the
head cannot propose the token), and the soft label is the target's distribution restricted to the vocabulary,
renormalised (EAGLE-3's and speculators' target_head = target logits at t2d).
The same DFlashDrafter.forward runs here and at inference; only the attention mask differs (training/attention.py),
so a test can check that the packed forward of every block equals the inference-time forward for that block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..drafter import DFlashDrafter
from .attention import LayerRule, attention_fn, build_masks

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
SOFT_LOSSES = ("kl", "lk")
LOGITS_BUDGET = 1 << 26  # logits (rows x vocabulary) computed in one piece without recomputation: 256 MiB in fp32


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


def draft_index(drafter: DFlashDrafter) -> torch.Tensor:
    """Target id -> its index in the drafter's head (-1 outside the draft vocabulary)."""
    index = torch.full_like(drafter.t2d, -1, dtype=torch.long)
    index[drafter.target_ids()] = torch.arange(drafter.spec.draft_vocab, device=index.device)
    return index


def draft_labels(drafter: DFlashDrafter, labels: torch.Tensor, weights: torch.Tensor):
    """(labels as draft ids, weights with every slot whose label is outside the draft vocabulary at 0)."""
    inside = drafter.t2d[labels]
    return torch.where(inside, draft_index(drafter)[labels], 0), torch.where(inside, weights, torch.zeros_like(weights))


def cached_soft_label(drafter: DFlashDrafter, logp: torch.Tensor, ids: torch.Tensor):
    """A cached top-k of the target (log-probabilities, target ids), as the soft label over the drafter's head:
    (probabilities renormalised over the top-k, head ids). With a draft vocabulary the tokens outside it get
    probability 0 before renormalising (the target's distribution restricted to the vocabulary); a slot with none
    of its top-k inside gets no soft label (all zeros)."""
    if drafter.spec.has_draft_vocab:
        index = draft_index(drafter)[ids]
        logp = torch.where(index >= 0, logp, torch.full_like(logp, float("-inf")))
        ids = index.clamp(min=0)
    return torch.softmax(logp.float(), -1).nan_to_num(0.0), ids


def context_length(drafter: DFlashDrafter, seq_len: int) -> int:
    """Context keys in the packed layout: every position (DFlash), none for the ablation modes (block only)."""
    return seq_len if drafter.spec.context_kv else 0


def packed_states(drafter: DFlashDrafter, x, features, positions, mask):
    """Final-normed drafter states (b, N*B, H) for the embedded blocks x (b, N*B, H) at once; `mask` is built for
    context_length(drafter, S) context keys."""
    b, s = features.shape[:2]
    rope_q = drafter.rope(positions, x)
    spec = drafter.spec
    if spec.context_kv:
        ctx = drafter.project_context(features)
        ctx_pos = torch.arange(s, device=features.device).expand(b, s)
        rope_kv = drafter.rope(torch.cat([ctx_pos, positions], 1), x)
        return drafter(x, ctx, rope_q, rope_kv, attention_fn(mask), block=spec.block_size)
    fused = None
    if spec.context_mode == "input":
        anchors = positions[:, ::spec.block_size]
        fused = drafter.fused_input(drafter.project_context(features), anchors, spec.block_size)
    return drafter(x, x[:, :0], rope_q, rope_q, attention_fn(mask), fused, block=spec.block_size)


def packed_forward(drafter: DFlashDrafter, embed, features, block_ids, positions, mask):
    """Final-normed drafter states (b, N*B, H) for every block at once."""
    return packed_states(drafter, embed(block_ids).to(features.dtype), features, positions, mask)


def selector_loss(selector, logits, hidden, predecessors, labels, top_k: int) -> torch.Tensor:
    """DFlash2's candidate selector, teacher-forced, per row: a top_k-way cross-entropy over the candidates
    inference would score (the top-k of the draft logits), with the gold token put in place of the weakest one
    where it is missing, so every row has a label; the predecessor is the gold token before the label (the anchor
    at the block's first slot), the path the walk takes while its choices are right."""
    candidates = logits.detach().topk(top_k, dim=-1).indices
    hit = candidates == labels[:, None]
    present = hit.any(-1)
    candidates[:, -1] = torch.where(present, candidates[:, -1], labels)
    gold = torch.where(present, hit.int().argmax(-1), top_k - 1)
    return F.cross_entropy(selector.score(logits, hidden, predecessors, candidates), gold, reduction="none")


def chunked_block_loss(hidden, lm_head, labels, weights, target_hidden=None, kl_weight: float = 0.0,
                       target_top=None, chunk: int = 4096, selector=None, predecessors=None, selector_top_k: int = 16,
                       selector_weight: float = 1.0, soft_loss: str = "kl") -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * slot loss) and sum(w * correct) over rows with w > 0. Past LOGITS_BUDGET the LM head is applied chunk
    by chunk under activation checkpointing, so full-vocabulary logits never exist for all rows at once (nor are
    kept for backward). The soft label of kl_weight > 0 is either the full LM-head distribution of `target_hidden`
    (b, N*B, H: the target's final-normed state that predicts each slot's label), recomputed in backward, or
    `target_top` = (probabilities, token ids), each (b, N*B, k): the target's top-k, renormalised. With a DFlash2
    `selector` each slot's loss adds selector_weight x selector_loss (`predecessors` (b, N*B): the gold token before
    each label)."""
    h = hidden.flatten(0, 1)
    y, w = labels.flatten(), weights.flatten()
    keep = w > 0
    h, y, w = h[keep], y[keep], w[keep]
    soft = kl_weight > 0
    if soft and target_top is not None:
        q_all, idx_all = (x.flatten(0, 1)[keep] for x in target_top)
    elif soft:
        q_all, idx_all = target_hidden.flatten(0, 1)[keep], None
    p_all = predecessors.flatten()[keep] if selector is not None else None

    def piece(h_, y_, w_, q_, i_, p_):
        logits = lm_head(h_).float()
        loss = F.cross_entropy(logits, y_, reduction="none")
        if soft:
            if i_ is None:  # the whole distribution: recomputed in backward rather than kept for every chunk
                with torch.no_grad():
                    q_ = torch.softmax(lm_head(q_).float(), -1)
            logp = torch.log_softmax(logits, -1)
            logp = logp if i_ is None else logp.gather(-1, i_)  # (over the soft label's tokens)
            if soft_loss == "lk":  # (q below p's top-k mass on the rest: min(p, q) there is 0)
                term = -torch.minimum(q_, logp.exp()).sum(-1).clamp(min=1e-6).log()
            else:
                term = -(q_ * logp).sum(-1)
            loss = (1 - kl_weight) * loss + kl_weight * term
        if selector is not None:
            loss = loss + selector_weight * selector_loss(selector, logits, h_, p_, y_, selector_top_k)
        return (loss * w_).sum(), ((logits.argmax(-1) == y_).float() * w_).sum()

    # small logits (a small vocabulary, few rows) in one piece and kept for backward; large ones chunk by chunk,
    # recomputed in backward: the LM head then runs twice, but memory stays at one chunk of logits
    whole = h.shape[0] * lm_head.weight.shape[0] <= LOGITS_BUDGET
    chunk = max(h.shape[0], 1) if whole else chunk
    loss = h.new_zeros((), dtype=torch.float32)
    correct = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        part = slice(i, i + chunk)
        q = q_all[part] if soft else None
        idx = idx_all[part] if soft and idx_all is not None else None
        args = (h[part], y[part], w[part], q, idx, p_all[part] if p_all is not None else None)
        recompute = torch.is_grad_enabled() and not whole
        l, c = checkpoint(piece, *args, use_reentrant=False) if recompute else piece(*args)
        loss, correct = loss + l, correct + c
    return loss, correct


@torch.no_grad()
def target_top_k(lm_head, target_final: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's k most likely next tokens at every position, renormalised: (probabilities, ids), (b, S, k).
    Once per position, not per block slot (blocks overlap: each position labels several slots)."""
    top, idx = lm_head(target_final).float().topk(min(k, lm_head.weight.shape[0]), dim=-1)
    return torch.softmax(top, -1), idx  # softmax of the top-k logits = the top-k of the softmax, renormalised


def block_loss_sum(drafter: DFlashDrafter, embed, lm_head, features, input_ids, loss_mask, anchors, valid, *,
                   block_size: int, mask_token_id: int, gamma: float | None = None, use_flex: bool | None = None,
                   forward=None, rules=None, target_final=None, kl_weight: float = 0.0, kl_top_k: int = 0,
                   cached_top=None, selector_weight: float = 1.0,
                   soft_loss: str = "kl") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised pieces of the loss for given anchors: (sum w*loss, sum w*correct, sum w). The trainer divides by
    the weight sum of the whole global batch, so the loss does not depend on how the batch is split across ranks
    and micro-batches. `forward(x, features, positions, mask)` replaces packed_forward (a DDP/FSDP wrapper).
    `rules`: one LayerRule per draft layer (default: full attention, the whole context). `target_final` (b, S, H):
    the target's final-normed hidden states, needed when kl_weight > 0 (soft label: its top `kl_top_k` tokens, or
    the whole distribution with kl_top_k 0), or `cached_top` = (log-probabilities, target ids), each (b, S, k): the
    target's top-k at every position from a feature cache (then target_final is not needed). A DFlash2 drafter's
    selector is trained alongside, with weight `selector_weight` (0: not at all). A drafter with a draft vocabulary
    uses its own head in place of `lm_head` (for the soft label too: the target's rows of those tokens)."""
    gamma = gamma or default_gamma(block_size)
    ids, pos, labels, weights = build_blocks(input_ids, loss_mask, anchors, valid, block_size, mask_token_id, gamma)
    if drafter.spec.has_draft_vocab:
        lm_head = drafter.lm_head
        labels, weights = draft_labels(drafter, labels, weights)
    s = input_ids.shape[1]
    use_flex = features.is_cuda if use_flex is None else use_flex
    rules = rules or [LayerRule()] * drafter.spec.num_hidden_layers
    mask = build_masks(anchors, context_length(drafter, s), block_size, rules, "flex" if use_flex else "split")
    if forward is None:
        hidden = packed_forward(drafter, embed, features, ids, pos, mask)
    else:
        hidden = forward(embed(ids).to(features.dtype), features, pos, mask)
    target_hidden = target_top = None
    if kl_weight > 0:
        # the label at position p is predicted by the target's state at p - 1 (slot k >= 1, so p - 1 >= anchor)
        prev = (pos - 1).clamp(min=0, max=s - 1)
        at = lambda x: x.gather(1, prev[..., None].expand(-1, -1, x.shape[-1]))
        if cached_top is not None:
            target_top = cached_soft_label(drafter, *(at(x) for x in cached_top))
        elif kl_top_k:
            target_top = tuple(at(x) for x in target_top_k(lm_head, target_final, kl_top_k))
        else:
            target_hidden = at(target_final)
    selector = predecessors = None
    if drafter.spec.is_dflash2 and selector_weight > 0:
        selector = drafter.candidate_selector
        per_block = labels.view(labels.shape[0], -1, block_size)  # slot 0's label is the anchor token itself
        predecessors = torch.cat([per_block[..., :1], per_block[..., :-1]], -1).flatten(1)
    loss_sum, correct = chunked_block_loss(hidden, lm_head, labels, weights, target_hidden, kl_weight, target_top,
                                           selector=selector, predecessors=predecessors,
                                           selector_top_k=drafter.spec.selector_top_k or 0,
                                           selector_weight=selector_weight, soft_loss=soft_loss)
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
def target_features(model, capture, input_ids, attention_mask=None, final: bool = False):
    """Frozen target forward, keeping only the captured layers (no logits are computed). With `final`, also the
    decoder's final-normed hidden states (b, S, H): what the target's LM head reads."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    feats = capture.pop()
    return (feats, out.last_hidden_state) if final else feats


def cosine_lr(step: int, total: int, lr: float, warmup_ratio: float = 0.04, min_ratio: float = 0.0) -> float:
    warm = max(1, int(round(total * warmup_ratio)))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
