"""Penalties and biases through the engine on both backends: rows with a repetition penalty beside greedy rows in a
batch that verifies trees of different widths (padding slots need a history too: MLX raised IndexError and failed
the batch); every penalty field exact under speculative decoding (greedy output equals target-only greedy output
with the same field, token for token), and each field changes the output."""

import pytest

from dflash import backends
from dflash.core.budget import Costs
from dflash.core.loop import Batch, Generation, generate
from dflash.core.sampling import SamplingParams

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not backends.available("mlx"), reason="needs mlx and mlx-lm"))]
# a CPU-like device (every verified token costs): auto gives each row its own tree size
STEEP = Costs(draft=0.5, verify=[(1, 1.0), (2, 1.2), (16, 1.6), (64, 4.0)])


def load(pair, name, draft=True):
    target_dir, draft_dir = pair
    return backends.get(name).load(target_dir, draft_dir if draft else None, dtype="float32", device="cpu")


def tree_engine(pair, name):
    """An engine that verifies a tree every cycle, sized per row by auto's rule under STEEP costs."""
    engine = load(pair, name)
    engine.set_verify("auto", 48, STEEP)
    engine.planner.path = lambda: "tree"  # (auto's chain-or-tree choice follows wall time; its sizes do not)
    for clock in engine.planner.clock.values():
        clock.observe = lambda *a: None
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
        widths = [len(t.tokens) for t in engine.last_trees]
        narrower += any(p and w < max(widths) for p, w in zip(live, widths))
    assert [g.result.error for g in gens] == [""] * 4
    assert [g.result.tokens for g in gens] == want
    assert narrower, "no penalised row was ever narrower than the batch's widest tree"
