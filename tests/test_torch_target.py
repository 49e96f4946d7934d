"""backends/torch/target.py: the target's grouped-query SDPA is exactly transformers' SDPA (K/V repeated per query
head), without the repeat, and targets load with it."""

import types

import pytest
torch = pytest.importorskip("torch")
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash.backends.torch.target import GROUPED_SDPA, load_target, sdpa_grouped


@pytest.mark.parametrize("rows,tokens,mask_heads,mask_rows,additive", [
    (3, 5, 1, 3, False),  # a batch's tree verify: one mask per row
    (2, 16, 8, 2, False),  # a mask per head
    (4, 3, 1, 1, False),  # one mask broadcast over the rows
    (2, 4, 1, 2, True),  # eager-style additive mask
    (3, 1, 1, 3, False),  # one token: transformers' own packing
])
def test_grouped_equals_repeated(rows, tokens, mask_heads, mask_rows, additive):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 8, 2, 16, 37
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    q = torch.randn(rows, heads, tokens, dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, slots, dim, generator=gen) for _ in range(2))
    mask = torch.rand(mask_rows, mask_heads, tokens, slots, generator=gen) > 0.3
    mask[..., -1] = True  # (no query sees nothing)
    if additive:
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    ours, _ = sdpa_grouped(module, q, k, v, mask, scaling=0.25)
    repeated = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    reference = torch.nn.functional.scaled_dot_product_attention(q, *repeated, attn_mask=mask, scale=0.25)
    assert ours.shape == (rows, tokens, heads, dim)
    torch.testing.assert_close(ours, reference.transpose(1, 2), rtol=1e-5, atol=1e-6)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_targets_load_with_it(tiny_target_dir):
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    assert model.config._attn_implementation == GROUPED_SDPA
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # (the tiny target groups its heads)
