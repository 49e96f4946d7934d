"""The training objective against the silent failures that give tau ~ 1: label shift, `kv <= anchor`, leaking blocks,
padding anchors, a training forward that differs from inference, dense vs Flex masks; and one sample overfitted
until the REAL speculative loop accepts nearly whole blocks."""

from __future__ import annotations

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.draft_cache import DraftContextCache
from dflash.backends.torch.draft_runner import draft_step, extend_context
from dflash.backends.torch.drafter import DFlashDrafter
from dflash.backends.torch.training import (SplitMask, block_loss_sum, build_blocks, cosine_lr, dense_mask, dflash_loss,
                                            flex_mask, packed_forward, sample_anchors)
from dflash.core.spec import DraftSpec

H, K, B, MASK = 32, 2, 4, 99


def make_spec(**kw) -> DraftSpec:
    fields = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, vocab_size=100, num_target_layers=4, target_layer_ids=[1, 2],
                  mask_token_id=MASK, block_size=B, rope_theta=10000.0, max_position_embeddings=512)
    fields.update(kw)
    return DraftSpec(**fields)


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    spec = make_spec()
    drafter = DFlashDrafter(spec).eval()
    for p in drafter.parameters():  # non-trivial norms too, so a swapped or skipped one shows
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    embed = torch.nn.Embedding(100, H)
    lm_head = torch.nn.Linear(H, 100, bias=False)
    return spec, drafter, embed, lm_head


def inference_block(drafter, embed, feats, anchor, block_ids, split: int):
    """The drafter's output for one block at inference: context = features of positions < anchor, absorbed as a
    prefill (extend_context) of `split` positions and the rest inside the draft step, like the backend does."""
    cache = DraftContextCache(drafter.spec, torch.float32, "cpu", capacity=4)
    extend_context(drafter, feats[:, :split], cache)
    return draft_step(drafter, embed(block_ids[None]), feats[:, split:anchor], [anchor - split], cache)[0]


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dense", "split"])
def test_packed_forward_equals_inference_forward_for_every_block(parts, kind):
    spec, drafter, embed, _ = parts
    s = 24
    ids = torch.randint(0, 90, (1, s))
    feats = torch.randn(1, s, K * H)
    anchors = torch.tensor([[1, 5, 6, 13, 22]])  # adjacent, overlapping-range and past-the-end blocks
    valid = torch.ones_like(anchors, dtype=torch.bool)
    mask = torch.ones(1, s, dtype=torch.bool)
    block_ids, pos, _, _ = build_blocks(ids, mask, anchors, valid, B, MASK, 4.0)
    m = dense_mask(anchors, s, B) if kind == "dense" else SplitMask(anchors, s, B)
    packed = packed_forward(drafter, embed, feats, block_ids, pos, m)[0]
    for j, a in enumerate(anchors[0].tolist()):
        for split in sorted({0, a // 2, a}):
            ref = inference_block(drafter, embed, feats, a, block_ids[0, j * B:(j + 1) * B], split)
            torch.testing.assert_close(packed[j * B:(j + 1) * B], ref, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_context_is_strictly_before_the_anchor(parts):
    spec, drafter, embed, _ = parts
    s, a = 16, 7
    ids = torch.randint(0, 90, (1, s))
    feats = torch.randn(1, s, K * H)
    anchors, valid = torch.tensor([[a]]), torch.tensor([[True]])
    blk, pos, _, _ = build_blocks(ids, torch.ones(1, s, dtype=torch.bool), anchors, valid, B, MASK, 4.0)
    m = dense_mask(anchors, s, B)[0, 0]
    assert m[:, :a].all() and not m[:, a:s].any()  # kv < anchor, not <=
    assert m[:, s:].all()  # bidirectional inside the block (not causal)
    out = lambda f: packed_forward(drafter, embed, f, blk, pos, dense_mask(anchors, s, B))
    base = out(feats)
    later = feats.clone()
    later[:, a:] += 5.0  # the anchor's own features are unknown at inference: they must not matter
    torch.testing.assert_close(out(later), base)
    earlier = feats.clone()
    earlier[:, a - 1] += 5.0
    assert not torch.allclose(out(earlier), base)


def test_split_attention_equals_dense_mask_with_gradients():
    """The CPU training path (context and own block scored separately, one softmax) is the dense rule exactly,
    for grouped-query heads, padded anchors (0) and blocks running past the sequence end."""
    from dflash.backends.torch.training import attention_fn

    torch.manual_seed(0)
    b, h, kvh, d, s, n = 2, 4, 2, 8, 30, 5
    anchors = torch.tensor([[0, 3, 4, 17, 29], [0, 0, 2, 11, 12]])
    q = torch.randn(b, h, n * B, d, requires_grad=True)
    k = torch.randn(b, kvh, s + n * B, d, requires_grad=True)
    v = torch.randn(b, kvh, s + n * B, d, requires_grad=True)
    dense = attention_fn(dense_mask(anchors, s, B))(0, q, k, v)
    split = attention_fn(SplitMask(anchors, s, B))(0, q, k, v)
    torch.testing.assert_close(split, dense, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(dense)
    grads = [torch.autograd.grad((out * w).sum(), (q, k, v)) for out in (dense, split)]
    for a, b_ in zip(*grads):
        torch.testing.assert_close(b_, a, atol=1e-5, rtol=1e-5)


def test_blocks_do_not_see_each_other():
    anchors = torch.tensor([[2, 9]])
    m = dense_mask(anchors, 12, B)[0, 0]
    assert not m[:B, 12 + B:].any() and not m[B:, 12:12 + B].any()
    assert m[B:, :9].all() and not m[B:, 9:12].any()


def test_labels_are_the_tokens_at_anchor_plus_k():
    ids = torch.arange(10, 30)[None]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[0, :3] = False
    anchors, valid = torch.tensor([[3, 17]]), torch.tensor([[True, True]])
    blk, pos, labels, w = build_blocks(ids, loss_mask, anchors, valid, B, MASK, 4.0)
    assert blk[0, :B].tolist() == [13, MASK, MASK, MASK]  # slot 0 = the clean anchor token, then masks
    assert pos[0, :B].tolist() == [3, 4, 5, 6]
    assert labels[0, 1:B].tolist() == [14, 15, 16]  # slot k predicts x[anchor + k]
    assert w[0, 0] == 0 and (w[0, 1:B] > 0).all()  # slot 0 has no loss
    torch.testing.assert_close(w[0, 1:B], torch.exp(-torch.arange(3.0) / 4.0))
    # anchor 17 of a 20-token sequence: slots past the end carry no loss
    assert w[0, B:].tolist()[1:] == [pytest.approx(1.0), pytest.approx(torch.exp(torch.tensor(-0.25)).item()), 0.0]


def test_anchor_sampling_and_padding_anchors_are_masked():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    # valid anchors: the position and the next one supervised -> {2, 3, 6}
    assert sorted(anchors[valid].tolist()) == [2, 3, 6] and valid.sum() == 3
    _, _, _, w = build_blocks(torch.zeros(1, 10, dtype=torch.long), loss_mask, anchors, valid, B, MASK, 4.0)
    assert (w.view(6, B)[~valid[0]] == 0).all()
    # and they do not move the loss: padding anchors contribute exactly nothing
    spec = make_spec(num_hidden_layers=1, target_layer_ids=[1])
    torch.manual_seed(0)
    d = DFlashDrafter(spec)
    embed, head = torch.nn.Embedding(100, H), torch.nn.Linear(H, 100, bias=False)
    feats = torch.randn(1, 10, H)
    ids = torch.randint(0, 90, (1, 10))
    full = block_loss_sum(d, embed, head, feats, ids, loss_mask, anchors, valid, block_size=B, mask_token_id=MASK)
    keep = valid[0]
    trimmed = block_loss_sum(d, embed, head, feats, ids, loss_mask, anchors[:, keep], valid[:, keep], block_size=B,
                             mask_token_id=MASK)
    torch.testing.assert_close(full[0], trimmed[0])
    torch.testing.assert_close(full[2], trimmed[2])


@torch.no_grad()
def test_dense_mask_equals_flex_mask(parts):
    from torch.nn.attention.flex_attention import create_mask

    from dflash.backends.torch.training import mask_rule

    spec, drafter, embed, _ = parts
    s = 40
    anchors = torch.tensor([[0, 3, 17, 38], [5, 6, 7, 30]])
    dense = dense_mask(anchors, s, B)
    n = anchors.shape[1] * B
    flex_dense = create_mask(mask_rule(anchors, s, B), 2, None, n, s + n, device="cpu")
    assert torch.equal(flex_dense.expand_as(dense), dense)
    # the attention outputs agree (flex_attention runs on CPU without grad)
    ids = torch.randint(0, 90, (2, s))
    feats = torch.randn(2, s, K * H)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blk, pos, _, _ = build_blocks(ids, torch.ones(2, s, dtype=torch.bool), anchors, valid, B, MASK, 4.0)
    out_dense = packed_forward(drafter, embed, feats, blk, pos, dense)
    out_flex = packed_forward(drafter, embed, feats, blk, pos, flex_mask(anchors, s, B))
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-4)


def test_dflash_loss_backward_and_cosine():
    spec = make_spec(num_hidden_layers=1, target_layer_ids=[1])
    torch.manual_seed(0)
    d = DFlashDrafter(spec)
    embed, head = torch.nn.Embedding(100, H), torch.nn.Linear(H, 100, bias=False)
    ids = torch.randint(0, 90, (2, 20))
    loss, info = dflash_loss(d, embed, head, torch.randn(2, 20, H), ids, torch.ones(2, 20, dtype=torch.bool),
                             block_size=B, num_anchors=5, mask_token_id=MASK)
    loss.backward()
    assert torch.isfinite(loss) and d.fc.weight.grad is not None and info["anchors"] == 10
    lrs = [cosine_lr(s, 100, 1.0, 0.04) for s in range(100)]
    assert lrs[0] == pytest.approx(0.25) and max(lrs) == pytest.approx(1.0) and lrs[-1] < 0.01


# ---- end to end: one sample overfitted, measured with the real loop ------------------------------------------------
@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory):
    """A tiny target with sharp logits (see tests/tiny_pair.py) and its greedy continuation of a prompt."""
    from tiny_pair import build_tiny_target, greedy_samples

    d = tmp_path_factory.mktemp("sharp_target")
    model = build_tiny_target(d / "target", seed=3)
    return d / "target", model


def test_overfitting_one_sample_reaches_nearly_full_blocks(sharp_target, tmp_path):
    """The whole pipeline (anchors, packed forward, loss, optimiser, export, loader, torch_engine, loop): trained
    on the target's own greedy continuation of one prompt, the drafter must get nearly every block accepted when
    the target regenerates that continuation. Any silent off-by-one keeps tau near 1."""
    from tiny_pair import greedy_samples
    from dflash.backends.torch.training import TrainConfig
    from dflash.train import run_training

    target_dir, model = sharp_target
    sample = greedy_samples(model, 1, seed=5, prompt_len=8, answer_len=64)[0]
    cfg = TrainConfig(target=str(target_dir), samples=[sample], eval_prompts=[sample["input_ids"][:8]],
                      out=str(tmp_path / "run"), num_layers=1, block_size=8, num_anchors=64, max_steps=120,
                      lr=1e-2, warmup_ratio=0.05, save_every=0, eval_every=60, eval_at_start=True,
                      eval_max_new_tokens=64, progress=False, plot=True, quiet=True, device="cpu")
    result = run_training(cfg)  # the command's run: curves.png too
    assert result.losses[-1] < 0.2 * result.losses[0]
    assert [e["step"] for e in result.evals] == [0, 60, 120]
    assert result.evals[0]["tau"] < 2  # untrained
    assert result.tau >= 0.8 * 8, result.evals[-1]
    assert len(result.evals[-1]["per_position"]) == 7 and result.evals[-1]["per_position"][0] > 0.9
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    # the exported checkpoint, loaded the way users load it, gives the same acceptance on the chain the evaluation
    # verifies (auto's choices follow timings measured at load)
    import dflash

    pipe = dflash.load(str(target_dir), str(result.draft_dir), backend="torch", device="cpu", dtype="float32",
                       verify="chain")
    r = pipe.generate(sample["input_ids"][:8], max_new_tokens=64)
    assert r.tokens == sample["input_ids"][8:8 + 64]
    assert r.mean_acceptance_length == pytest.approx(result.tau)
