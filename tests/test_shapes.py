"""dflash.core.shapes: a row's proposal shape follows the acceptance its own earlier cycles saw, and nothing else."""

import pytest

from dflash.core.sampling import RowSampling, SamplingParams, draft_temperatures, row_draws
from dflash.core.shapes import EXPLORE, MATCH_SHAPES, MIN_TESTED, SHAPES, ShapeChoice


def warmed(rates: dict, verified: int = 4) -> ShapeChoice:
    """A choice past its warm-up: each shape observed in turn, accepting rates[t] of `verified` per cycle."""
    choice = ShapeChoice(tuple(rates))
    while min(choice.tested) < MIN_TESTED:
        t = choice.choose(0.9)
        choice.observe(t, rates[t], verified)
    return choice


def test_every_shape_is_tested_first_then_the_best_is_kept():
    choice = ShapeChoice((1.0, 0.5, 0.0))
    first = [choice.choose(0.5) for _ in range(2)]
    choice.observe(1.0, 7, 8)  # one lucky cycle of q: the others still get their turn
    assert first == [1.0, 1.0] and choice.choose(0.5) == 0.5
    choice = warmed({1.0: 1, 0.5: 2, 0.0: 3})
    assert [choice.choose(u) for u in (0.5, 0.9, EXPLORE + 1e-9)] == [0.0, 0.0, 0.0]
    for _ in range(40):  # the text changes: q accepts everything now
        choice.observe(1.0, 4, 4)
    assert choice.choose(0.5) == 1.0


def test_exploration_covers_every_shape_and_reads_only_its_uniform():
    choice = warmed({t: 2 if t == 0.5 else 0 for t in SHAPES})
    picks = {choice.choose(u) for u in [(i + 0.5) / 300 * EXPLORE for i in range(300)]}
    assert picks == set(SHAPES)
    assert {choice.choose(u) for u in (EXPLORE, 0.5, 0.99)} == {0.5}
    before = list(choice.tested)
    choice.observe(0.0, 0, 0)  # a cycle that verified nothing (a plain step) teaches nothing
    assert choice.tested == before


@pytest.mark.parametrize("accept, seed, shapes", [
    ("auto", None, (1.0,)), ("auto", 3, MATCH_SHAPES), ("argmax", None, (0.0,)), ("sharpened", None, (0.25,)),
    ("rejection", None, (1.0,)), ("match", 3, (1.0,)), ("shaped", 3, SHAPES)])
def test_each_rule_chooses_among_its_shapes(accept, seed, shapes):
    params = SamplingParams(temperature=0.8, seed=seed, accept=accept, draft_temperature=0.25)
    row = RowSampling.admit(params)
    assert draft_temperatures(row.rule, params.draft_temperature, accept == "auto") == shapes == row.shapes.temperatures


def test_a_cycles_shape_is_fixed_before_its_draws():
    """The shape of the cycle at position n depends on the row's past observations and the exploration uniform of
    position n alone: two rows with the same seed and history choose alike whatever else the batch holds."""
    a, b = (RowSampling.admit(SamplingParams(temperature=0.8, seed=7, accept="shaped")) for _ in range(2))
    for row in (a, b):
        for _ in range(8):
            for t, accepted in ((0.0, 3), (0.5, 2), (1.0, 1)):
                row.shapes.observe(t, accepted, 4)
    greedy = RowSampling.admit(SamplingParams())
    gumbel = lambda keys: None  # noqa: E731  (this test reads no target noise)
    for n in range(40):
        alone = row_draws([[1] * n], [a], gumbel, 4)
        batched = row_draws([[2] * 3, [1] * n], [greedy, b], gumbel, 4)
        assert alone[0].draft_temperature == batched[1].draft_temperature
    assert {row_draws([[1] * n], [a], gumbel, 4)[0].draft_temperature for n in range(200)} == set(SHAPES)
