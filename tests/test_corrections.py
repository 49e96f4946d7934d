"""Per-shape corrections of a cost profile: learnt from the engine's cycles, blind to cycles that say nothing of the
device."""

import pytest

from dflash.core.corrections import Corrections


def test_a_shapes_first_ratio_becomes_its_factor_and_later_ones_move_it():
    c = Corrections()
    c.observe(16, 1, True, predicted=0.010, seconds=0.030)  # a profile measured on an idle core, now busy
    assert c.factor(16, 1, True) == 3.0 and c.factor(1, 1, False) == 3.0  # (a shape not run yet: the average)
    c.observe(16, 1, True, predicted=0.010, seconds=0.010)
    assert 1.0 < c.factor(16, 1, True) < 3.0


def test_a_cycle_that_compiled_a_graph_is_not_learnt():
    """A compiled target's first forward of a shape takes seconds where the profile says milliseconds: it must not
    become the shape's factor (auto would stop drafting for dozens of cycles)."""
    c = Corrections()
    c.observe(16, 1, True, predicted=0.010, seconds=20.0)
    c.observe(1, 1, False, predicted=0.005, seconds=0.00001)
    assert c.factors == {} and c.observed == 0
    assert c.factor(16, 1, True) == 1.0


def test_an_earlier_runs_factors_guide_until_this_run_measures_the_shape(tmp_path):
    """Factors saved by a run on a busy machine are read back as a starting guess; this run's first cycle of a shape
    replaces them (averaged into them, a 3x drift would take dozens of cycles to leave)."""
    path = tmp_path / "profile.corrections.json"
    busy = Corrections(path=path)
    for _ in range(8):
        busy.observe(16, 1, True, predicted=0.010, seconds=0.030)
    busy.save()
    quiet = Corrections.load(path)
    assert quiet.factor(16, 1, True) == 3.0 and quiet.factor(1, 1, False) == 3.0  # the guess, before any cycle
    quiet.observe(16, 1, True, predicted=0.010, seconds=0.011)
    assert quiet.factor(16, 1, True) == pytest.approx(1.1) and quiet.factor(1, 1, False) == pytest.approx(1.1)
    quiet.observe(16, 1, True, predicted=0.010, seconds=0.013)
    assert 1.1 < quiet.factor(16, 1, True) < 1.3  # from then on, averaged as before
