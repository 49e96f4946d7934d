"""The soft-label (--kl-weight) loss: the target's distribution at position p - 1 labels slot p, top-k truncation
with k = vocabulary is the full distribution, weight 0 is the paper's CE, and the soft label teaches the target's
ranking (a drafter fitted to it matches the target's distribution, not only its argmax), under either term
(--soft-loss kl: cross-entropy; lk: -log acceptance)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from dflash.backends.torch.training import chunked_block_loss
from dflash.backends.torch.training.objective import target_top_k

V, H = 50, 16


def setup(rows=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, generator=g)
    hidden = torch.randn(1, rows, H, generator=g, requires_grad=True)
    target = torch.randn(1, rows, H, generator=g)
    labels = torch.randint(0, V, (1, rows), generator=g)
    weights = torch.rand(1, rows, generator=g) * (torch.arange(rows) % 3 != 0)  # some rows unsupervised
    return head, hidden, target, labels, weights


def test_kl_weight_zero_is_weighted_ce_and_one_is_soft_ce():
    head, hidden, target, labels, weights = setup()
    ce, _ = chunked_block_loss(hidden, head, labels, weights)
    ref = (F.cross_entropy(head(hidden[0]), labels[0], reduction="none") * weights[0]).sum()
    torch.testing.assert_close(ce, ref)
    soft, _ = chunked_block_loss(hidden, head, labels, weights, target, kl_weight=1.0, chunk=5)
    q = torch.softmax(head(target[0]), -1)
    ref_soft = (-(q * torch.log_softmax(head(hidden[0]), -1)).sum(-1) * weights[0]).sum()
    torch.testing.assert_close(soft, ref_soft)
    half, _ = chunked_block_loss(hidden, head, labels, weights, target, kl_weight=0.5)
    torch.testing.assert_close(half, 0.5 * ref + 0.5 * ref_soft)


def test_top_k_of_the_whole_vocabulary_is_the_full_distribution_and_gradients_match():
    head, hidden, target, labels, weights = setup()
    full, _ = chunked_block_loss(hidden, head, labels, weights, target, kl_weight=0.7, chunk=4)
    (g_full,) = torch.autograd.grad(full, hidden)
    top, _ = chunked_block_loss(hidden, head, labels, weights, kl_weight=0.7, target_top=target_top_k(head, target, V),
                                chunk=4)
    (g_top,) = torch.autograd.grad(top, hidden)
    torch.testing.assert_close(top, full)
    torch.testing.assert_close(g_top, g_full)
    q, idx = target_top_k(head, target, 3)
    assert q.shape == (1, 12, 3) and torch.allclose(q.sum(-1), torch.ones(1, 12))
    assert torch.equal(idx, head(target).topk(3, dim=-1).indices)
    trunc, _ = chunked_block_loss(hidden, head, labels, weights, kl_weight=0.7, target_top=(q, idx), chunk=4)
    assert not torch.allclose(trunc, full)  # truncation really changes the label


def fit_to_the_soft_label(soft_loss: str, steps: int = 600):
    """Draft states fitted with the soft label's term alone: (the draft's distribution, the target's)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    target = torch.randn(1, 4, H)
    hidden = torch.zeros(1, 4, H, requires_grad=True)
    opt = torch.optim.Adam([hidden], lr=0.05)
    labels, weights = torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4)
    for _ in range(steps):
        loss, _ = chunked_block_loss(hidden, head, labels, weights, target, kl_weight=1.0, soft_loss=soft_loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.softmax(head(hidden), -1), torch.softmax(head(target), -1)


def test_soft_label_fits_the_target_distribution():
    """Fitting the draft logits with the soft label alone recovers the target's whole distribution."""
    p_draft, p_target = fit_to_the_soft_label("kl")
    assert (p_draft - p_target).abs().max() < 0.05


def test_lk_is_minus_log_acceptance_and_top_k_of_everything_is_the_full_distribution():
    """soft_loss "lk": each slot's term is -log sum_x min(p(x), q(x)) = -log(1 - TV(p, q)), over the target's whole
    distribution or over its top-k (the rest counts as 0)."""
    head, hidden, target, labels, weights = setup()
    lk, _ = chunked_block_loss(hidden, head, labels, weights, target, kl_weight=1.0, chunk=5, soft_loss="lk")
    p, q = torch.softmax(head(target[0]), -1), torch.softmax(head(hidden[0]), -1)
    ref = (-torch.minimum(p, q).sum(-1).log() * weights[0]).sum()
    torch.testing.assert_close(lk, ref)
    tv = 0.5 * (p - q).abs().sum(-1)  # the identity the name rests on
    torch.testing.assert_close(torch.minimum(p, q).sum(-1), 1 - tv)
    top, _ = chunked_block_loss(hidden, head, labels, weights, kl_weight=1.0, target_top=target_top_k(head, target, V),
                                chunk=4, soft_loss="lk")
    torch.testing.assert_close(top, lk)
    kl, _ = chunked_block_loss(hidden, head, labels, weights, target, kl_weight=1.0, chunk=5)
    assert not torch.allclose(kl, lk)


def test_lk_fits_the_target_distribution():
    """Maximising the acceptance probability alone drives q to p (sum min(p, q) = 1 only at q = p)."""
    p_draft, p_target = fit_to_the_soft_label("lk")
    assert torch.minimum(p_draft, p_target).sum(-1).min() > 0.95


def test_chunked_recomputed_logits_equal_the_one_piece_path(monkeypatch):
    """Past LOGITS_BUDGET the loss runs chunk by chunk under checkpointing: same loss, same gradients."""
    import dflash.backends.torch.training.objective as objective

    head, hidden, target, labels, weights = setup(rows=23)
    results = []
    for budget in (objective.LOGITS_BUDGET, 0):
        monkeypatch.setattr(objective, "LOGITS_BUDGET", budget)
        for kw in ({}, {"target_hidden": target, "kl_weight": 0.5},
                   {"kl_weight": 0.5, "target_top": target_top_k(head, target, 7)}):
            loss, correct = objective.chunked_block_loss(hidden, head, labels, weights, chunk=5, **kw)
            results.append((loss, correct, torch.autograd.grad(loss, hidden)[0]))
    for one, chunked in zip(results[:3], results[3:]):
        for a, b in zip(one, chunked):
            torch.testing.assert_close(b, a)


def test_cached_soft_label_restricted_to_the_draft_vocabulary():
    """A cached top-k over the target's ids becomes the soft label over the drafter's head: renormalised over the
    top-k, tokens outside the draft vocabulary at 0, a position with none inside left without a soft label."""
    from types import SimpleNamespace

    from dflash.backends.torch.training.objective import cached_soft_label

    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 7]] = True  # draft ids 0, 1, 2
    drafter = SimpleNamespace(spec=SimpleNamespace(has_draft_vocab=True, draft_vocab=3), t2d=t2d,
                              target_ids=lambda: t2d.nonzero().flatten())
    logp = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]]))
    ids = torch.tensor([[[4, 2, 7], [0, 3, 5]]])  # 2 is outside; nothing of the second row is inside
    probs, head_ids = cached_soft_label(drafter, logp, ids)
    torch.testing.assert_close(probs[0, 0], torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7]))
    assert head_ids[0, 0, 0] == 1 and head_ids[0, 0, 2] == 2
    assert torch.equal(probs[0, 1], torch.zeros(3))
    full, same = cached_soft_label(SimpleNamespace(spec=SimpleNamespace(has_draft_vocab=False)), logp, ids)
    torch.testing.assert_close(full, torch.exp(logp) / torch.exp(logp).sum(-1, keepdim=True))
    assert torch.equal(same, ids)
