"""Batched speculative decoding (the engine with several rows on torch, through dflash.loop.generate_batch): every
row's greedy output equals its batch-1 output, rows stop on their own, holes in the caches are compacted without
changing a token."""

import pytest
import torch

from dflash.backends.torch.backend import TorchBackend
from dflash.backends.torch.drafter import load_drafter
from dflash.backends.torch.target import load_target
from dflash.backends.torch.target_runner import TorchTarget
from dflash.errors import DFlashError
from dflash.loop import generate, generate_batch
from dflash.sampling import SamplingParams


@pytest.fixture(scope="module")
def pair(trained_pair):
    target_dir, draft_dir = trained_pair
    target = load_target(target_dir, torch.float32, "cpu")
    return target, load_drafter(draft_dir)


@pytest.fixture(scope="module")
def mixed_prompts(prompts):
    return [p[: 4 + 3 * i] for i, p in enumerate(prompts[:8])]  # 4 .. 25 tokens: real left padding


def batched(target, drafter, block_size=16):
    return TorchBackend(target, drafter, block_size=block_size)


def single(target, drafter, block_size=16):
    return TorchBackend(target, drafter, block_size=block_size)


@pytest.mark.parametrize("block_size", [8, 16])
def test_every_row_equals_its_batch1_output(pair, mixed_prompts, block_size, monkeypatch):
    target, drafter = pair
    compactions = []
    monkeypatch.setattr(TorchTarget, "_compact",
                        lambda self, orig=TorchTarget._compact: (compactions.append(1), orig(self)))
    solo = single(target, drafter, block_size)
    want = [generate(solo, p, max_new_tokens=96) for p in mixed_prompts]
    solo.close()
    be = batched(target, drafter, block_size)
    got = generate_batch(be, mixed_prompts, max_new_tokens=96)
    be.close()
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        assert g.finish_reason == w.finish_reason == "length"
    taus = [g.mean_acceptance_length for g in got]
    assert max(taus) > 2 and max(taus) > min(taus), taus  # rows accept different prefixes: holes were made
    assert compactions, "a long batch never compacted its caches"


def test_rows_stop_on_their_own(pair, mixed_prompts, tiny_target_dir):
    """A frequent token as EOS makes rows finish at different cycles; the retired rows leave the batch and the
    others continue unchanged."""
    from transformers import AutoTokenizer

    target, drafter = pair
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    solo = single(target, drafter)
    first = generate(solo, mixed_prompts[0], max_new_tokens=64).tokens
    eos = {first[len(first) // 3]}  # a token this pair actually produces
    kw = dict(max_new_tokens=64, eos_token_ids=eos, tokenizer=tok)
    want = [generate(solo, p, **kw) for p in mixed_prompts]
    solo.close()
    be = batched(target, drafter)
    got = generate_batch(be, mixed_prompts, **kw)
    be.close()
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    lengths = {len(g.tokens) for g in got}
    assert len(lengths) > 1 and any(g.finish_reason == "stop" for g in got)


def test_autoregressive_batch_and_penalty(pair, mixed_prompts):
    """No drafter (batched baseline) and a logits processor that needs each row's own history."""
    target, _ = pair
    kw = dict(max_new_tokens=40, sampling=SamplingParams(repetition_penalty=1.3))
    want = [generate(single(target, None), p, **kw).tokens for p in mixed_prompts]
    got = generate_batch(batched(target, None), mixed_prompts, **kw)
    assert [g.tokens for g in got] == want
    assert all(a == 1 for g in got for a in g.acceptance_lengths)


def test_sampled_batch_is_well_formed(pair, mixed_prompts):
    target, drafter = pair
    be = batched(target, drafter)
    got = generate_batch(be, mixed_prompts, max_new_tokens=48, sampling=SamplingParams(temperature=1.0, seed=0))
    be.close()
    vocab = target.get_input_embeddings().weight.shape[0]
    for g in got:
        assert len(g.tokens) == 48 and all(0 <= t < vocab for t in g.tokens)
        # the first token comes from the prefill; the last cycle may commit more than max_new_tokens keeps
        assert sum(g.acceptance_lengths[:-1]) < 47 <= sum(g.acceptance_lengths)


def test_pipeline_batch_and_errors(trained_pair):
    import dflash

    target_dir, draft_dir = trained_pair
    pipe = dflash.load(target_dir, draft_dir, backend="torch", device="cpu")
    texts = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os"]
    got = pipe.generate_batch(texts, max_new_tokens=24)
    assert [g.tokens for g in got] == [pipe.generate(t, max_new_tokens=24).tokens for t in texts]
    assert pipe.generate_batch([]) == []
    with pytest.raises(DFlashError, match="sampling settings"):
        from dflash.loop import Generation, _cycles

        be = pipe.backend
        gens = [Generation(be, [1, 2], sampling=SamplingParams()),
                Generation(be, [1, 2], sampling=SamplingParams(temperature=1.0))]
        next(_cycles(be, gens))
    with pytest.raises(DFlashError, match="fit the target's context"):
        pipe.generate_batch([[1] * 100_000])
