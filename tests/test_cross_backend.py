"""The same target and draft directories, loaded by the torch and the MLX backend in float32 on the CPU,
give the same greedy tokens and the same drafted tokens in every cycle, with a drafter that gets long acceptances.

Both backends run the one loop (dflash/loop.py); what is compared is the arithmetic underneath: transformers vs
mlx-lm targets, the two drafter modules, layer capture, caches and cropping. Float32 differences between the
libraries stay far below the trained pair's logit margins, so the comparison is exact, not approximate.
"""

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")

from dflash import backends  # noqa: E402
from dflash.loop import generate  # noqa: E402


def load_both(target_dir, draft_dir, **kw):
    return (backends.get("torch").load(target_dir, draft_dir, dtype="float32", device="cpu", **kw),
            backends.get("mlx").load(target_dir, draft_dir, dtype="float32", device="cpu", **kw))


def held_out_prompts(n=10, length=8, seed=123):
    # the trained pair's prompt distribution (random ordinary tokens), a seed its training never saw
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n, length), generator=g).tolist()


def test_identical_tokens_and_drafts_with_long_acceptances(trained_pair):
    target_dir, draft_dir = trained_pair
    tb, mb = load_both(target_dir, draft_dir, block_size=16)
    lengths = []
    for p in held_out_prompts():
        a = generate(tb, p, max_new_tokens=128, trace=True)
        b = generate(mb, p, max_new_tokens=128, trace=True)
        assert a.tokens == b.tokens
        assert a.drafted == b.drafted  # every cycle's 15 proposals, not just the accepted ones
        assert a.acceptance_lengths == b.acceptance_lengths
        lengths += a.acceptance_lengths
    tau = sum(lengths) / len(lengths)
    assert tau >= 3.0, f"the trained drafter should accept long prefixes (tau {tau:.2f})"
    assert max(lengths) == 16


def test_identical_with_an_untrained_drafter(tiny_target_dir, random_draft_dir, prompts):
    """An untrained drafter turns tiny feature differences into different proposals at once: a strict check of
    layer capture and context bookkeeping (block 8 to exercise a block smaller than the trained one)."""
    tb, mb = load_both(tiny_target_dir, random_draft_dir, block_size=8)
    for p in prompts[:4]:
        a = generate(tb, p, max_new_tokens=48, trace=True)
        b = generate(mb, p, max_new_tokens=48, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted


def test_captured_features_agree(trained_pair):
    import numpy as np

    target_dir, draft_dir = trained_pair
    tb, mb = load_both(target_dir, draft_dir)
    ids = held_out_prompts(1, 24)[0]
    _, torch_feats = tb.target.forward(tb.target.ids([ids]), last_only=True)
    _, feats = mb.target.forward(mb.target.ids([ids]), last_only=True)
    np.testing.assert_allclose(np.array(feats), torch_feats.numpy(), rtol=1e-4, atol=1e-4)


def test_draft_top_k_agrees_and_matches_the_proposals(trained_pair):
    """The per-position top-k the drafter primitive returns (for tree verification): the same ids and probabilities
    on both backends, sorted, the first one being the proposal, probabilities of the drafter's softmax."""
    import mlx.core as mx
    import numpy as np

    target_dir, draft_dir = trained_pair
    tb, mb = load_both(target_dir, draft_dir, block_size=16)
    for be in (tb, mb):
        be.top_k = 4
    for p in held_out_prompts(3, 12):
        drafts = []
        for be in (tb, mb):
            (first,) = be.prefill([p])
            be.draft([first])
            d = be.last_draft
            drafts.append([np.array(d.ids), np.array(d.top_ids), np.array(d.top_probs)])
            if be is mb:
                mx.eval(d.top_ids)
        (ti, tk, tp), (mi, mk, mp) = drafts
        assert tk.shape == (1, 15, 4) and (tk[..., 0] == ti[:, 1:]).all()
        assert (np.diff(tp, axis=-1) <= 1e-7).all() and (tp.sum(-1) <= 1 + 1e-5).all()
        assert (tk == mk).all() and (ti == mi).all()
        np.testing.assert_allclose(tp, mp, rtol=1e-4, atol=1e-5)


def test_dflash2_identical_tokens_and_drafts(dflash2_pair):
    """DFlash2 (convolutions, sliding-window context, the selector's walk): the same drafts and tokens in float32."""
    target_dir, draft_dir = dflash2_pair
    tb, mb = load_both(target_dir, draft_dir)
    lengths = []
    for p in held_out_prompts(6):
        a = generate(tb, p, max_new_tokens=64, trace=True)
        b = generate(mb, p, max_new_tokens=64, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted and a.acceptance_lengths == b.acceptance_lengths
        lengths += a.acceptance_lengths
    assert max(lengths) >= 12 and any(2 <= n < 16 for n in lengths)


def test_dflash2_identical_with_an_untrained_drafter(tiny_target_dir, random_dflash2_dir, prompts):
    """Far-from-identity convolutions and codebooks, a draft window shorter than the context: identical drafts."""
    tb, mb = load_both(tiny_target_dir, random_dflash2_dir)
    for p in prompts[:4]:
        a = generate(tb, p, max_new_tokens=48, trace=True)
        b = generate(mb, p, max_new_tokens=48, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted
