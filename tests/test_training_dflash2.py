"""Training DFlash2 drafters: the packed forward keeps each block's convolutions inside it (as inference runs one
block), the selector's training scores are the ones its inference walk uses, the gold token is always a candidate,
and `python -m dflash.train --arch dflash2` lowers its loss and exports a drafter that loads and decodes losslessly."""

from __future__ import annotations

import json

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.draft_cache import DraftContextCache
from dflash.backends.torch.draft_runner import draft_step
from dflash.backends.torch.drafter import DFlashDrafter
from dflash.backends.torch.training import SplitMask, build_blocks, packed_forward
from dflash.backends.torch.training.objective import selector_loss
from dflash.core.spec import DFLASH2, DraftSpec

H, K, B, V, MASK = 32, 2, 4, 100, 99


def dflash2_spec(**kw) -> DraftSpec:
    fields = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, vocab_size=V, num_target_layers=4, target_layer_ids=[1, 2],
                  mask_token_id=MASK, block_size=B, rope_theta=10000.0, max_position_embeddings=512,
                  architecture=DFLASH2, conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5)
    return DraftSpec(**(fields | kw))


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    drafter = DFlashDrafter(dflash2_spec()).eval()
    for p in drafter.parameters():  # far from identity convolutions: a tap across blocks would show
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    return drafter, torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)


@torch.no_grad()
def test_packed_forward_equals_inference_for_every_block(parts):
    drafter, embed, _ = parts
    s = 20
    ids, feats = torch.randint(0, 90, (1, s)), torch.randn(1, s, K * H)
    anchors = torch.tensor([[2, 6, 7, 17]])  # adjacent blocks and one past the end
    everywhere = torch.ones(1, s, dtype=torch.bool)
    blocks, pos, _, _ = build_blocks(ids, everywhere, anchors, torch.ones_like(anchors, dtype=torch.bool), B, MASK, 4.0)
    packed = packed_forward(drafter, embed, feats, blocks, pos, SplitMask(anchors, s, B))[0]
    for j, a in enumerate(anchors[0].tolist()):
        cache = DraftContextCache(drafter.spec, torch.float32, "cpu", capacity=4)
        ref = draft_step(drafter, embed(blocks[0, j * B:(j + 1) * B][None]), feats[:, :a], [a], cache)[0]
        torch.testing.assert_close(packed[j * B:(j + 1) * B], ref, atol=2e-5, rtol=1e-4)


def test_selector_loss_scores_as_the_walk_does_and_keeps_the_gold_token(parts):
    drafter, _, _ = parts
    selector, k = drafter.candidate_selector, drafter.spec.selector_top_k
    torch.manual_seed(1)
    rows = 6
    logits, hidden = torch.randn(rows, V), torch.randn(rows, H)
    predecessors = torch.randint(0, V, (rows,))
    # inference's all-pairs scores, with each row as the first position after anchor = its predecessor
    candidates, pairs = selector.pair_scores(logits[:, None], hidden[:, None], predecessors[:, None], k)
    torch.testing.assert_close(selector.score(logits, hidden, predecessors, candidates[:, 0]), pairs[:, 0, 0])
    # a gold token inside the top-k is labelled where it is; one outside takes the weakest candidate's place
    inside, outside = candidates[0, 0, 2], logits[1].argsort()[0]
    labels = torch.stack([inside, outside])
    loss = selector_loss(selector, logits[:2], hidden[:2], predecessors[:2], labels, k)
    scores = selector.score(logits[:2], hidden[:2], predecessors[:2], torch.stack(
        [candidates[0, 0], torch.cat([candidates[1, 0, :-1], outside[None]])]))
    expected = torch.nn.functional.cross_entropy(scores, torch.tensor([2, k - 1]), reduction="none")
    torch.testing.assert_close(loss, expected)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert selector.successor_codebook.grad[outside].abs().sum() > 0  # the injected gold token is trained


@torch.no_grad()
def test_a_dflash_drafter_starts_a_dflash2_one_unchanged(parts):
    """--arch dflash2 --init-from DFLASH_DIR: the DFlash weights, identity convolutions, a new selector; the block
    states are the DFlash drafter's until training moves them."""
    from dflash.backends.torch.training import TrainConfig
    from dflash.backends.torch.training.model import as_dflash2

    _, embed, _ = parts
    torch.manual_seed(2)
    source = DFlashDrafter(dflash2_spec(architecture="DFlashDraftModel", conv_kernel_size=None, conv_group_size=None,
                                        selector_rank=None, selector_top_k=None)).eval()
    cfg = TrainConfig(arch="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=5)
    converted = as_dflash2(source, cfg, std=0.02).eval()
    assert converted.spec.is_dflash2 and converted.spec.layer_types == ["sliding_attention"] * 2
    s, anchors = 12, torch.tensor([[1, 6]])
    ids, feats = torch.randint(0, 90, (1, s)), torch.randn(1, s, K * H)
    everywhere = torch.ones(1, s, dtype=torch.bool)
    blocks, pos, _, _ = build_blocks(ids, everywhere, anchors, torch.ones_like(anchors, dtype=torch.bool), B, MASK, 4.0)
    states = [packed_forward(d, embed, feats, blocks, pos, SplitMask(anchors, s, B)) for d in (source, converted)]
    torch.testing.assert_close(states[1], states[0])


@pytest.fixture(scope="module")
def sharp_pair(tmp_path_factory):
    """A tiny target with sharp logits, 24 of its greedy continuations to train on and 2 prompts held out."""
    from tiny_pair import build_tiny_target, greedy_samples

    root = tmp_path_factory.mktemp("dflash2_train")
    model = build_tiny_target(root / "target", seed=3)
    samples = greedy_samples(model, 26, seed=5, prompt_len=8, answer_len=32)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": x["input_ids"], "loss_mask": [int(m) for m in x["loss_mask"]]})
                            + "\n" for x in samples[:24]))
    return root / "target", data, samples[:24], samples[24:]


@pytest.mark.slow
def test_arch_dflash2_run_lowers_its_loss_and_exports_a_lossless_drafter(sharp_pair, tmp_path):
    import dflash
    from dflash.core.spec import DraftSpec
    from dflash.train import main

    target, data, trained, held = sharp_pair
    out = tmp_path / "run"
    assert main(["--model", str(target), "--data", str(data), "--out", str(out), "--arch", "dflash2",
                 "--num-layers", "1", "--block-size", "8", "--num-anchors", "16", "--batch-size", "4",
                 "--max-steps", "30", "--lr", "1e-2", "--selector-rank", "16", "--selector-top-k", "8",
                 "--save-every", "0", "--device", "cpu", "--no-progress", "--plot", "false", "--quiet"]) == 0
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.6 * sum(losses[:5]), losses

    spec = DraftSpec.load(out / "draft")
    assert spec.is_dflash2 and (spec.selector_rank, spec.selector_top_k, spec.conv_kernel_size) == (16, 8, 2)
    assert spec.layer_types == ["sliding_attention"] and spec.extra.get("is_causal") is False
    pipe = dflash.load(str(target), str(out / "draft"), backend="torch", device="cpu", dtype="float32",
                       verify="chain")
    taus = []
    for sample in held + trained[-2:]:
        prompt, answer = sample["input_ids"][:8], sample["input_ids"][8:]
        r = pipe.generate(prompt, max_new_tokens=len(answer))
        assert r.tokens == answer  # greedy speculative output = the target's own greedy continuation
        taus.append(r.mean_acceptance_length)
    # 30 steps are few: on the answers it trained on the drafter gets blocks accepted (untrained: ~1.0)
    assert sum(taus[-2:]) / 2 > 1.3, taus
