"""The packed training forward attends exactly as inference does, for every layer kind a config can declare:
full or sliding (`layer_types`, `sliding_window`), causal inside the block or not (`is_causal`), with or without the
draft context window. The rule is one predicate (training/attention.draft_attends); it is checked key by key
against the inference draft caches of both backends, and the packed forward against the inference forward."""

from __future__ import annotations

import itertools

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.draft_cache import DraftContextCache
from dflash.backends.torch.draft_runner import draft_step, extend_context
from dflash.backends.torch.drafter import DFlashDrafter
from dflash.backends.torch.training import (LayerRule, build_blocks, build_masks, dense_mask, draft_attends,
                                            layer_rules, mask_rule, packed_forward)
from dflash.core.spec import DraftSpec

H, K, B, MASK = 32, 2, 4, 99
RULES = [(sliding, causal, window) for sliding, causal, window in
         itertools.product([None, 2, 3, 6], [None, False, True], [None, 4])]


def make_spec(layer_types, sliding=None, causal=None) -> DraftSpec:
    return DraftSpec(hidden_size=H, num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=64, vocab_size=100, num_target_layers=4,
                     target_layer_ids=[1, 2], mask_token_id=MASK, block_size=B, rope_theta=10000.0,
                     max_position_embeddings=512, sliding_window=sliding, use_sliding_window=sliding is not None,
                     layer_types=list(layer_types), extra={} if causal is None else {"is_causal": causal})


def one_layer_spec(sliding, causal):
    return make_spec(["sliding_attention" if sliding else "full_attention"], sliding, causal)


def expected_keys(n_ctx: int, rule: LayerRule) -> list[set[int]]:
    """Absolute key positions block slot j may see, by the predicate: the block starts at position n_ctx."""
    keys = torch.arange(n_ctx + B)
    return [set(keys[draft_attends(n_ctx + j, keys, n_ctx, keys >= n_ctx, rule)].tolist()) for j in range(B)]


def seen_keys(k_span, mask, n_keys: int) -> list[set[int]]:
    """Key positions (stored in channel 0) each block slot attends to, given the span and mask a cache returned."""
    pos = [int(x) for x in k_span]
    return [{p for i, p in enumerate(pos) if mask is None or bool(mask[j][i])} for j in range(n_keys)]


def position_keys(start: int, n: int, d: int = 8) -> torch.Tensor:
    k = torch.zeros(1, 2, n, d)
    k[..., 0] = torch.arange(start, start + n, dtype=torch.float32)
    return k


@pytest.mark.parametrize("sliding,causal,window", RULES)
def test_predicate_equals_torch_draft_cache(sliding, causal, window):
    spec = one_layer_spec(sliding, causal)
    (rule,) = layer_rules(spec, window)
    cache = DraftContextCache(spec, torch.float32, "cpu", capacity=2, window=window)
    for n_ctx in range(0, 14):  # context grows 1 position per cycle; the window moves entries when the buffer fills
        cache.reserve(B)
        k_span, _, mask = cache.write(0, position_keys(n_ctx, B), position_keys(n_ctx, B), [0], B)
        got = seen_keys(k_span[0, 0, :, 0].tolist(), None if mask is None else mask[0, 0].tolist(), B)
        assert got == expected_keys(n_ctx, rule), (n_ctx, rule)
        cache.reserve(1)
        cache.write(0, position_keys(n_ctx, 1), position_keys(n_ctx, 1), [1], 0)
        cache.advance([1])


@pytest.mark.mlx
@pytest.mark.parametrize("sliding,causal,window", RULES)
def test_predicate_equals_mlx_draft_cache(sliding, causal, window):
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    from dflash.backends.mlx.draft_cache import DraftContextCache as MlxDraftCache

    spec = one_layer_spec(sliding, causal)
    (rule,) = layer_rules(spec, window)
    cache = MlxDraftCache(spec, mx.float32, capacity=2, window=window)
    as_mx = lambda t: mx.array(t.numpy())
    for n_ctx in range(0, 14):
        cache.reserve(B)
        k_span, _, mask = cache.write(0, as_mx(position_keys(n_ctx, B)), as_mx(position_keys(n_ctx, B)), [0], B)
        seen = None if mask is None else np.array(mask)[0, 0].tolist()
        got = seen_keys(np.array(k_span)[0, 0, :, 0].tolist(), seen, B)
        assert got == expected_keys(n_ctx, rule), (n_ctx, rule)
        cache.reserve(1)
        cache.write(0, as_mx(position_keys(n_ctx, 1)), as_mx(position_keys(n_ctx, 1)), [1], 0)
        cache.advance([1])


def test_default_rule_is_the_dflash_rule():
    """Full attention, no window: the whole context strictly before the anchor and the whole own block."""
    keys = torch.arange(10)
    seen = draft_attends(8, keys, 6, keys >= 6)
    assert seen.tolist() == [True] * 6 + [True] * 4  # context 0..5, block 6..9 (a later slot too: not causal)
    assert not draft_attends(8, 7, 7, False) and draft_attends(8, 6, 7, False)  # kv < anchor, not <=


@pytest.fixture(scope="module")
def modules():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(100, H)
    return embed


def drafter_for(spec):
    torch.manual_seed(1)
    d = DFlashDrafter(spec).eval()
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    return d


@torch.no_grad()
@pytest.mark.parametrize("kind", ["split", "dense"])
@pytest.mark.parametrize("causal,window", [(None, None), (False, None), (None, 5), (True, 7)])
def test_packed_forward_equals_inference_for_sliding_layers(modules, kind, causal, window):
    """Layer 0 sliding (window 3), layer 1 full: the packed forward of every block equals the draft step on a
    context cache holding exactly the context before the anchor, absorbed partly as prefill like the backend does."""
    embed = modules
    spec = make_spec(["sliding_attention", "full_attention"], sliding=3, causal=causal)
    drafter = drafter_for(spec)
    s = 24
    ids, feats = torch.randint(0, 90, (1, s)), torch.randn(1, s, K * H)
    anchors = torch.tensor([[1, 5, 6, 13, 22]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    block_ids, pos, _, _ = build_blocks(ids, torch.ones(1, s, dtype=torch.bool), anchors, valid, B, MASK, 4.0)
    masks = build_masks(anchors, s, B, layer_rules(spec, window), kind)
    packed = packed_forward(drafter, embed, feats, block_ids, pos, masks)[0]
    for j, a in enumerate(anchors[0].tolist()):
        for split in sorted({0, a // 2, a}):
            cache = DraftContextCache(spec, torch.float32, "cpu", capacity=4, window=window)
            extend_context(drafter, feats[:, :split], cache)
            ref = draft_step(drafter, embed(block_ids[0, j * B:(j + 1) * B][None]), feats[:, split:a], [a - split],
                             cache)[0]
            torch.testing.assert_close(packed[j * B:(j + 1) * B], ref, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_sliding_rules_change_the_forward(modules):
    """Not a rule that cannot fail: the sliding layer's mask really differs from full attention's."""
    anchors = torch.tensor([[9]])
    full, sliding = dense_mask(anchors, 12, B), dense_mask(anchors, 12, B, LayerRule(3, True, None))
    assert full[0, 0, 0, :9].all() and sliding[0, 0, 0, :9].tolist() == [False] * 7 + [True] * 2
    assert full[0, 0, 0, 12:].all() and sliding[0, 0, 0, 12:].tolist() == [True, False, False, False]


def test_flex_mask_mod_equals_dense_for_sliding_rules():
    from torch.nn.attention.flex_attention import create_mask

    anchors = torch.tensor([[0, 3, 17, 38], [5, 6, 7, 30]])
    s, n = 40, anchors.shape[1] * B
    for rule in (LayerRule(3, True, None), LayerRule(6, False, 9), LayerRule(None, True, 4)):
        dense = dense_mask(anchors, s, B, rule)
        flex = create_mask(mask_rule(anchors, s, B, rule), 2, None, n, s + n, device="cpu")
        assert torch.equal(flex.expand_as(dense), dense)
