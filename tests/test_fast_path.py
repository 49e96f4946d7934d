"""The fast path (preallocated StaticCache, torch.compile of the fixed-shape decode forwards) stays lossless."""

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.draft_cache import StaticDraftCache
from dflash.backends.torch.drafter import load_drafter
from dflash.backends.torch.target import load_target
from dflash.core.loop import generate

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def pair(trained_pair):
    target_dir, draft_dir = trained_pair
    prompts = torch.randint(3, 500, (4, 8), generator=torch.Generator().manual_seed(7)).tolist()
    return target_dir, draft_dir, prompts


def _check(model, drafter, prompts, n=64, **fast):
    baseline = [generate(torch_engine(model), p, max_new_tokens=n).tokens for p in prompts]
    ar_fast = torch_engine(model, **fast)
    spec_fast = torch_engine(model, drafter, **fast)
    taus = []
    for p, ref in zip(prompts, baseline):
        assert generate(ar_fast, p, max_new_tokens=n).tokens == ref  # target-only on the fast path
        r = generate(spec_fast, p, max_new_tokens=n)
        assert r.tokens == ref
        taus.append(r.mean_acceptance_length)
    assert max(taus) > 2  # long acceptances: crop of the static cache is exercised


def test_static_cache_lossless(pair):
    target_dir, draft_dir, prompts = pair
    _check(load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir), prompts, cache_len=256)


def test_static_cache_overflow_is_one_line(pair):
    from dflash.core.errors import DFlashError

    target_dir, draft_dir, prompts = pair
    be = torch_engine(load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir), cache_len=24)
    with pytest.raises(DFlashError, match="static cache"):
        generate(be, prompts[0], max_new_tokens=64)


def test_fixed_shape_drafter_matches_dynamic(pair, monkeypatch):
    """The compiled drafter's fixed-shape forward (static context buffer, padded new context, device-side offsets),
    run eagerly here: lossless, and its proposals are the dynamic drafter's."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # eager: the same fixed-shape code
    target_dir, draft_dir, prompts = pair
    model, drafter = load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir)
    fixed = torch_engine(model, drafter, cache_len=256, compile=True, compile_draft=True)
    assert isinstance(fixed.drafter.cache, StaticDraftCache)  # the fixed-shape forward runs
    dynamic = torch_engine(model, drafter)
    for p in prompts:
        a = generate(fixed, p, max_new_tokens=64, trace=True)
        b = generate(dynamic, p, max_new_tokens=64, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted
    fixed.crop(3)  # a shorter prompt after a longer one: the static context is cut, not rebuilt
    assert generate(fixed, prompts[0][:5], max_new_tokens=16).tokens == \
        generate(dynamic, prompts[0][:5], max_new_tokens=16).tokens


def test_windows_change_as_the_context_grows(pair, monkeypatch):
    """A static cache of 1024 positions attends over 256, then 512 (the target's and the fixed-shape drafter's
    windows): the output is the dynamic cache's across the change."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # eager: the same windowed code
    target_dir, draft_dir, prompts = pair
    model, drafter = load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir)
    prompt = (prompts[0] * 40)[:240]  # 240 + 48 tokens cross the first window
    for draft in (None, drafter):
        fixed = torch_engine(model, draft, cache_len=1024, compile=True, compile_draft=draft is not None)
        dynamic = torch_engine(model, draft)
        assert generate(fixed, prompt, max_new_tokens=48).tokens == generate(dynamic, prompt, max_new_tokens=48).tokens


def test_the_drafter_compiles_on_cuda_only_unless_asked(pair, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # (the choice is made whether or not it compiles)
    target_dir, draft_dir, _ = pair
    model, drafter = load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir)
    assert not isinstance(torch_engine(model, drafter, cache_len=64, compile=True).drafter.cache, StaticDraftCache)


@pytest.mark.slow
def test_compiled_pipeline_lossless_cpu(tiny_target_dir, random_draft_dir):
    """dflash.load(compile=True): greedy output equals the eager pipeline's, plain and speculative."""
    import dflash

    for no_draft in (True, False):
        kw = dict(backend="torch", no_draft=no_draft, dtype="float32", verify="chain")
        compiled = dflash.load(tiny_target_dir, None if no_draft else random_draft_dir, compile=True,
                               cache_len=128, **kw)
        eager = dflash.load(tiny_target_dir, None if no_draft else random_draft_dir, **kw)
        for prompt in ([5, 6, 7], list(range(10, 40))):
            assert compiled.generate(prompt, max_new_tokens=24).tokens == eager.generate(prompt, max_new_tokens=24).tokens


@pytest.mark.slow
def test_compiled_decode_lossless_cpu(pair):
    target_dir, draft_dir, prompts = pair
    _check(load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir), prompts[:2], n=32,
           cache_len=128, compile=True)


@pytest.mark.gpu
@cuda
def test_cuda_graphs_bf16_lossless(pair):
    target_dir, draft_dir, prompts = pair
    model = load_target(target_dir, torch.bfloat16, "cuda")
    _check(model, load_drafter(draft_dir, dtype=torch.bfloat16, device="cuda"), prompts, cache_len=256, compile=True)


@pytest.mark.gpu
@cuda
def test_flex_mask_equals_dense_on_cuda():
    from dflash.backends.torch import training as T
    from dflash.backends.torch.drafter import DFlashDrafter
    from dflash.core.spec import DraftSpec

    spec = DraftSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=256, vocab_size=1000, num_target_layers=8, target_layer_ids=[1, 5],
                     mask_token_id=999, block_size=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec).cuda()
    embed = torch.nn.Embedding(1000, 128).cuda()
    s = 300
    feats = torch.randn(2, s, 256, device="cuda")
    ids = torch.randint(0, 990, (2, s), device="cuda")
    loss_mask = torch.rand(2, s, device="cuda") > 0.3
    anchors, valid = T.sample_anchors(loss_mask, 12)
    bids, pos, _, _ = T.build_blocks(ids, loss_mask, anchors, valid, 16, 999, 7.0)
    dense = T.packed_forward(drafter, embed, feats, bids, pos, T.dense_mask(anchors, s, 16))
    flex = T.packed_forward(drafter, embed, feats, bids, pos, T.flex_mask(anchors, s, 16))
    torch.testing.assert_close(flex, dense, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_compiled_drafter_lossless_cpu(pair):
    """The fixed-shape drafter through torch.compile (one cache write per buffer, device-side offsets): the same
    proposals and tokens as the dynamic drafter."""
    target_dir, draft_dir, prompts = pair
    model, drafter = load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir)
    compiled = torch_engine(model, drafter, cache_len=128, compile=True, compile_draft=True)
    assert isinstance(compiled.drafter.cache, StaticDraftCache)  # the fixed-shape forward, compiled
    dynamic = torch_engine(model, drafter)
    for p in prompts[:2]:
        a = generate(compiled, p, max_new_tokens=48, trace=True)
        b = generate(dynamic, p, max_new_tokens=48, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted
