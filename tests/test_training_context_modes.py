"""The ablation drafters of dflash.core.spec `context_mode` (none: no target features; input: input fusion): the packed
training forward equals the inference draft step for every block, each sees exactly the target features it claims
to, the checkpoint round-trips strictly, and everything that would leave the torch backend refuses them in one line."""

from __future__ import annotations

import json

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.draft_cache import BlockOnlyContext
from dflash.backends.torch.draft_runner import TorchDraft, absorb_block_only, block_step
from dflash.backends.torch.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash.backends.torch.training import SplitMask, build_blocks, dense_mask, packed_forward
from dflash.core.errors import DFlashError
from dflash.core.spec import DraftSpec

from test_training import B, H, K, MASK, make_spec  # the packed-forward test spec

MODES = ["none", "input"]


def random_drafter(mode: str) -> DFlashDrafter:
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_spec(context_mode=mode)).eval()
    for p in drafter.parameters():  # non-trivial norms too, so a swapped or skipped one shows
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    return drafter


def packed(drafter, embed, ids, feats, anchors, kind="split"):
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blk, pos, _, _ = build_blocks(ids, torch.ones_like(ids, dtype=torch.bool), anchors, valid, B, MASK, 4.0)
    # the ablation modes have no context keys: the packed mask is built for 0 of them (objective.context_length)
    m = dense_mask(anchors, 0, B) if kind == "dense" else SplitMask(anchors, 0, B)
    return blk, packed_forward(drafter, embed, feats, blk, pos, m)[0]


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dense", "split"])
@pytest.mark.parametrize("mode", MODES)
def test_packed_forward_equals_inference_draft_step_for_every_block(mode, kind):
    drafter = random_drafter(mode)
    embed = torch.nn.Embedding(100, H)
    s = 24
    ids, feats = torch.randint(0, 90, (1, s)), torch.randn(1, s, K * H)
    anchors = torch.tensor([[1, 5, 6, 13, 22]])
    blk, out = packed(drafter, embed, ids, feats, anchors, kind)
    for j, a in enumerate(anchors[0].tolist()):
        for split in sorted({0, a // 2, a}):  # prefill absorbs `split` positions, the draft step the rest
            context = BlockOnlyContext(drafter.spec, torch.float32, "cpu", capacity=4)
            absorb_block_only(drafter, feats[:, :split], [split], context)
            ref = block_step(drafter, embed(blk[:, j * B:(j + 1) * B]), feats[:, split:a], [a - split], context)
            torch.testing.assert_close(out[j * B:(j + 1) * B], ref[0], atol=2e-5, rtol=1e-4)
            assert context.position == a


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_row_of_the_block_only_context_is_kept_alone(mode):
    """What the prefix cache asks of a draft context (TorchDraft.extract, cache_bytes): row 1 alone, its length
    and (input fusion) its features copied out."""
    drafter = random_drafter(mode)
    context = BlockOnlyContext(drafter.spec, torch.float32, "cpu", capacity=8)
    other = BlockOnlyContext(drafter.spec, torch.float32, "cpu", capacity=8)
    feats = torch.randn(1, 5, K * H)
    absorb_block_only(drafter, feats[:, :3], [3], context)
    absorb_block_only(drafter, feats, [5], other)
    context.merge(other)
    row = context.extract(1)
    assert row.lengths == [5] and context.lengths == [3, 5]
    if mode == "input":
        torch.testing.assert_close(row.features[0, :5], other.features[0, :5])
        assert context.nbytes == 2 * row.nbytes > 0
    else:
        assert row.features is None and row.nbytes == context.nbytes == 0


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_sees_exactly_its_target_features(mode):
    """none: no feature matters. input: only the feature of the position before the anchor."""
    drafter = random_drafter(mode)
    embed = torch.nn.Embedding(100, H)
    s, a = 16, 7
    ids, feats = torch.randint(0, 90, (1, s)), torch.randn(1, s, K * H)
    anchors = torch.tensor([[a]])
    _, base = packed(drafter, embed, ids, feats, anchors)
    others = feats.clone()
    others[:, :a - 1] += 5.0
    others[:, a:] += 5.0
    torch.testing.assert_close(packed(drafter, embed, ids, others, anchors)[1], base)
    last = feats.clone()
    last[:, a - 1] += 5.0
    changed = not torch.allclose(packed(drafter, embed, ids, last, anchors)[1], base)
    assert changed == (mode == "input")


def test_checkpoint_round_trip_and_weights(tmp_path):
    for mode in MODES:
        drafter = random_drafter(mode)
        save_drafter(drafter, tmp_path / mode)
        cfg = json.loads((tmp_path / mode / "config.json").read_text())
        assert cfg["dflash_config"]["context_mode"] == mode
        loaded = load_drafter(tmp_path / mode)
        assert loaded.spec.context_mode == mode
        assert ("fc.weight" in loaded.state_dict()) == (mode == "input")
        for k, v in drafter.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v)
    assert "context_mode" not in make_spec().to_dict()["dflash_config"]  # public checkpoints are unchanged
    # an input-fusion config over weights without a projection is refused, not randomly initialised
    (tmp_path / "none" / "config.json").write_text(
        (tmp_path / "none" / "config.json").read_text().replace('"context_mode": "none"', '"context_mode": "input"'))
    with pytest.raises(DFlashError, match="fc.weight"):
        load_drafter(tmp_path / "none")


def test_spec_refusals():
    with pytest.raises(DFlashError, match=r"dflash_config.context_mode' must be one of kv, none, input; got 'eagle'"):
        make_spec(context_mode="eagle").check()
    with pytest.raises(DFlashError, match="full, non-causal attention layers only"):
        make_spec(context_mode="none", sliding_window=8, use_sliding_window=True).check()
    with pytest.raises(DFlashError, match=r"^--push-to-hub: .*'input', an ablation mode of the torch backend only"):
        make_spec(context_mode="input").check_public("--push-to-hub")
    make_spec().check_public("--push-to-hub")


def test_exports_and_other_backends_refuse_ablation_drafters(tmp_path):
    from dflash.train import push_to_hub

    save_drafter(random_drafter("input"), tmp_path / "d")
    with pytest.raises(DFlashError, match=r"^--push-to-hub: .*context_mode is 'input'"):
        push_to_hub(tmp_path / "d", "someone/never-uploaded")  # refused before any network call
    with pytest.raises(DFlashError, match=r"^compile: dflash_config.context_mode 'input'"):
        TorchDraft(random_drafter("input"), torch.nn.Embedding(100, H), torch.nn.Linear(H, 100), static_capacity=64)
    pytest.importorskip("mlx.core")
    from dflash.backends.mlx.drafter import DFlashDrafter as MLXDrafter
    from dflash.converters.quantize import quantize_drafter

    with pytest.raises(DFlashError, match=r"^--backend mlx: .*context_mode is 'none'"):
        MLXDrafter(make_spec(context_mode="none"))
    with pytest.raises(DFlashError, match=r"^quantize: .*context_mode is 'input'"):
        quantize_drafter(tmp_path / "d", tmp_path / "q")
    assert not (tmp_path / "q").exists()


@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory):
    from tiny_pair import build_tiny_target

    d = tmp_path_factory.mktemp("sharp_target") / "target"
    return d, build_tiny_target(d, seed=3)


@pytest.mark.parametrize("mode", MODES)
def test_trained_ablation_drafter_runs_the_speculative_loop_losslessly(mode, sharp_target, tmp_path):
    """train() builds the variant, exports it and measures it with the real loop; loaded as users load it, the
    same drafter's output equals the target's greedy decoding token for token."""
    import dflash
    from tiny_pair import greedy_samples
    from dflash.backends.torch.training import TrainConfig, train

    target_dir, model = sharp_target
    samples = greedy_samples(model, 4, seed=1, prompt_len=6, answer_len=32)
    prompt = samples[0]["input_ids"][:6]
    cfg = TrainConfig(target=str(target_dir), samples=samples, eval_prompts=[prompt], out=str(tmp_path / "run"),
                      num_layers=1, block_size=4, num_anchors=16, max_steps=8, lr=1e-2, context_mode=mode,
                      save_every=0, eval_max_new_tokens=32, progress=False, plot=False, quiet=True, device="cpu")
    result = train(cfg)
    assert DraftSpec.load(result.draft_dir).context_mode == mode and result.evals
    plain = dflash.load(str(target_dir), backend="torch", no_draft=True, device="cpu", dtype="float32")
    pipe = dflash.load(str(target_dir), str(result.draft_dir), backend="torch", device="cpu", dtype="float32",
                       verify="chain")  # the chain, as the training evaluation measures it
    r = pipe.generate(prompt, max_new_tokens=32)
    assert r.tokens == plain.generate(prompt, max_new_tokens=32).tokens == samples[0]["input_ids"][6:38]
    assert r.mean_acceptance_length == pytest.approx(result.tau)


def test_input_fusion_starts_at_the_token_embeddings_scale(sharp_target):
    from dflash.backends.torch.training import init_drafter

    _, model = sharp_target
    rms = model.get_input_embeddings().weight.pow(2).mean().sqrt()
    spec = make_spec(hidden_size=model.config.hidden_size, vocab_size=model.get_input_embeddings().weight.shape[0],
                     context_mode="input", mask_token_id=1, num_target_layers=-1,
                     num_attention_heads=model.config.num_attention_heads,
                     num_key_value_heads=model.config.num_key_value_heads, head_dim=model.config.head_dim)
    fused = init_drafter(spec, model, "target-first", 0).project_context(torch.randn(3, 5, 2 * spec.hidden_size))
    torch.testing.assert_close(fused.pow(2).mean().sqrt(), rms, rtol=0.05, atol=0)
