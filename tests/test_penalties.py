"""Penalties and biases through the engine on both backends: rows with a repetition penalty beside greedy rows in a
batch that verifies trees of different widths (padding slots need a history too: MLX raised IndexError and failed
the batch); every penalty field exact under speculative decoding (greedy output equals target-only greedy output
with the same field, token for token), and each field changes the output."""


import numpy as np
import pytest

from dflash import backends
from cycle_devices import FixedTimes
from dflash.core.loop import Batch, Generation, generate
from dflash.core.sampling import SamplingParams

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not backends.available("mlx"), reason="needs mlx and mlx-lm"))]


def load(pair, name, draft=True):
    target_dir, draft_dir = pair
    return backends.get(name).load(target_dir, draft_dir if draft else None, dtype="float32", device="cpu")


def tree_engine(pair, name):
    """An engine whose greedy rows verify a tree every cycle, sized per row by auto's rule on a CPU-like device (every
    verified token costs), drafting the whole block."""
    engine = load(pair, name)
    engine.set_verify("auto", 48, FixedTimes(plain=1.0, token=0.02, draft=0.05), itl_limit=None)
    engine.policy.planner.path = lambda *_: "tree"  # (auto's chain-or-tree choice; its sizes are the point here)
    engine.policy.planner.blocks = [engine.block_size]
    return engine


@pytest.mark.parametrize("name", BACKENDS)
def test_penalised_rows_beside_greedy_rows_in_trees_of_different_widths(trained_pair, prompts, name):
    engine = tree_engine(trained_pair, name)
    target_only = load(trained_pair, name, draft=False)
    penalised = SamplingParams(repetition_penalty=1.05)
    settings = [SamplingParams(), penalised, penalised, SamplingParams()]
    chosen = prompts[:4]
    want = [generate(target_only, p, max_new_tokens=48, sampling=s).tokens for p, s in zip(chosen, settings)]
    batch = Batch(engine)
    gens = [Generation(engine, p, max_new_tokens=48, sampling=s) for p, s in zip(chosen, settings)]
    for g in gens:
        batch.join(g)
    narrower = 0  # cycles where a penalised row's tree was padded to a wider row's
    while batch:
        live = [s.repetition_penalty != 1.0 for s in (g.sampling for g in batch.generations)]
        batch.step()
        widths = [len(t.tokens) for t in engine.policy.planner.last_trees]
        narrower += any(p and w < max(widths) for p, w in zip(live, widths))
    assert [g.result.error for g in gens] == [""] * 4
    assert [g.result.tokens for g in gens] == want
    assert narrower, "no penalised row was ever narrower than the batch's widest tree"


def field_settings(plain: list[int]) -> dict[str, SamplingParams]:
    """One setting per field, strong enough to change the tiny target's greedy output on one of two prompts at least
    (the bias bans the token plain greedy decoding emits third); and a seeded sampled row (match: target-only sampling
    with that seed)."""
    return {"presence_penalty": SamplingParams(presence_penalty=2.0),
            "frequency_penalty": SamplingParams(frequency_penalty=0.8),
            "logit_bias": SamplingParams(logit_bias=((plain[2], -100.0),)),
            "all, sampled": SamplingParams(temperature=0.8, seed=5, accept="match", repetition_penalty=1.1,
                                           presence_penalty=0.5, frequency_penalty=0.3,
                                           logit_bias=((plain[1], 3.0),))}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("verify", ["chain", "trees"])
def test_each_field_is_exact_under_speculative_decoding(trained_pair, prompts, name, verify):
    """Rows with each field in one batch (chain verification, or auto-sized trees: its greedy rows, as a sampled row
    makes the batch verify chains): every row's output is target-only decoding's with the same field, token for
    token, and differs from plain greedy output."""
    target_only = load(trained_pair, name, draft=False)
    engine = tree_engine(trained_pair, name) if verify == "trees" else load(trained_pair, name)
    chosen = prompts[4:6]
    plain = [generate(target_only, p, max_new_tokens=40).tokens for p in chosen]
    rows = [(p, label, s) for p, q in zip(chosen, plain) for label, s in field_settings(q).items()
            if verify == "chain" or s.greedy]
    want = [generate(target_only, p, max_new_tokens=40, sampling=s).tokens for p, _, s in rows]
    batch = Batch(engine)
    gens = [Generation(engine, p, max_new_tokens=40, sampling=s) for p, _, s in rows]
    for g in gens:
        batch.join(g)
    while batch:
        batch.step()
    changed = set()
    for g, w, (p, label, _) in zip(gens, want, rows):
        assert g.result.tokens == w, label
        if w != plain[chosen.index(p)]:
            changed.add(label)
    for label in {label for _, label, _ in rows}:  # (each field changes at least one prompt's greedy output)
        assert label == "all, sampled" or label in changed, f"{label} did not change the output"
    accepted = [n for g in gens for n in g.result.acceptance_lengths]
    assert max(accepted) > 2, "no cycle accepted two draft tokens: the penalties never saw accepted drafts"


def processed(name: str, params: SamplingParams, logits: np.ndarray, history, block, paths, start) -> np.ndarray:
    """The backend's processed logits (T, V) for the T positions after history + block[:i+1] (or + paths[i])."""
    if name == "torch":
        import torch

        from dflash.backends.torch.sampling import TorchSampler
        out = TorchSampler(params).scores(torch.tensor(logits), history, torch.tensor(block), paths, start)
        return out.numpy()
    import mlx.core as mx

    from dflash.backends.mlx.sampling import MLXSampler
    return np.array(MLXSampler(params).processed(mx.array(logits), history, mx.array(block), paths, start))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("tree", [False, True])
def test_each_position_is_penalised_by_the_tokens_before_it(name, tree):
    """Position i of a verified block is processed as target-only decoding processes it: the logit bias added,
    the repetition penalty over prompt + output + block[:i+1], presence and frequency over output + block[:i+1]
    (a tree: + the path to node i; padding slots: the root's)."""
    rng = np.random.default_rng(0)
    vocab, history, start = 12, [1, 2, 3, 3, 4, 5, 5, 5], 4  # prompt [1, 2, 3, 3]: the output is [4, 5, 5, 5]
    block = [5, 6, 6, 2, 6]
    paths = [[5], [5, 6], [5, 2], [5, 6, 6], [5, 2, 2], [5]] if tree else None
    logits = rng.normal(size=(len(paths) if tree else len(block), vocab)).astype(np.float32)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4,
                            logit_bias=((0, 2.0), (6, -1.5)))
    want = logits.copy()
    for i, row in enumerate(want):
        before = (paths[i] if tree else block[: i + 1])
        row[0] += 2.0
        row[6] -= 1.5
        for token in set(history + before):
            row[token] = row[token] * 1.3 if row[token] < 0 else row[token] / 1.3
        output = history[start:] + before
        for token in set(output):
            row[token] -= 0.7 + 0.4 * output.count(token)
    got = processed(name, params, logits, history, block, paths, start)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
