"""Per-shape corrections of a cost profile: learnt from the engine's cycles, blind to cycles that say nothing of the
device."""

import json

import pytest

from dflash.core.corrections import MAX_STEP, Corrections


def test_a_shapes_first_cycle_warms_up_its_next_ratio_becomes_its_factor_and_later_ones_move_it():
    c = Corrections()
    c.observe(16, 1, True, predicted=0.010, seconds=0.200)  # (allocation, graph building: not learnt)
    assert c.factors == {}
    c.observe(16, 1, True, predicted=0.010, seconds=0.030)  # a profile measured on an idle core, now busy
    assert c.factor(16, 1, True) == 3.0 and c.factor(1, 1, False) == 3.0  # (a shape not run yet: the average)
    c.observe(16, 1, True, predicted=0.010, seconds=0.010)
    assert 1.0 < c.factor(16, 1, True) < 3.0


def test_one_stalled_cycle_moves_a_factor_by_at_most_max_step():
    """Averaged plainly, one cycle at 40x made a factor of 1 into 8.8: auto stopped choosing the shape, so nothing
    corrected it again."""
    c = Corrections()
    for _ in range(10):
        c.observe(8, 1, True, predicted=0.010, seconds=0.010)
    c.observe(8, 1, True, predicted=0.010, seconds=0.400)
    assert c.factor(8, 1, True) == pytest.approx(MAX_STEP)
    for _ in range(10):
        c.observe(8, 1, True, predicted=0.010, seconds=0.010)
    assert c.factor(8, 1, True) < 1.03


def test_a_lasting_change_is_followed_within_dozens_of_cycles():
    c = Corrections()
    for _ in range(5):
        c.observe(8, 1, True, predicted=0.010, seconds=0.010)
    for n in range(1, 41):  # another process takes the core: every cycle 4x slower from now on
        c.observe(8, 1, True, predicted=0.010, seconds=0.040)
        if c.factor(8, 1, True) > 3.6:
            break
    assert n <= 25


def test_a_cycle_that_compiled_a_graph_is_not_learnt():
    """A compiled target's first forward of a shape takes seconds where the profile says milliseconds: it must not
    become the shape's factor (auto would stop drafting for dozens of cycles)."""
    c = Corrections()
    c.observe(16, 1, True, predicted=0.010, seconds=20.0)
    c.observe(1, 1, False, predicted=0.005, seconds=0.00001)
    assert c.factors == {} and c.observed == 0
    assert c.factor(16, 1, True) == 1.0


def test_an_earlier_runs_average_guides_until_this_runs_first_timed_cycle(tmp_path):
    """The average saved by a run on a busy machine is read back as a starting guess; this run's first timed cycle
    replaces it (averaged into it, a 3x drift would take dozens of cycles to leave)."""
    path = tmp_path / "profile.corrections.json"
    busy = Corrections(path=path)
    for _ in range(9):
        busy.observe(16, 1, True, predicted=0.010, seconds=0.030)
    busy.save()
    quiet = Corrections.load(path)
    assert quiet.factor(16, 1, True) == 3.0 and quiet.factor(1, 1, False) == 3.0  # the guess, before any cycle
    quiet.observe(16, 1, True, predicted=0.010, seconds=0.020)  # (warm-up)
    assert quiet.factor(16, 1, True) == 3.0
    quiet.observe(16, 1, True, predicted=0.010, seconds=0.011)
    assert quiet.factor(16, 1, True) == pytest.approx(1.1) and quiet.factor(1, 1, False) == pytest.approx(1.1)
    quiet.observe(16, 1, True, predicted=0.010, seconds=0.013)
    assert 1.1 < quiet.factor(16, 1, True) < 1.3  # from then on, averaged as before


def test_a_shape_that_one_run_priced_out_starts_the_next_run_at_the_average(tmp_path):
    """A shape one run priced at 13x (auto never chose it again, so never corrected it) costs the next run what every
    shape not run yet costs: the average."""
    path = tmp_path / "profile.corrections.json"
    path.write_text(json.dumps({"all": 0.9, "draft:1x8": 13.5, "draft:1x16": 1.1}))
    loaded = Corrections.load(path)
    assert loaded.factor(8, 1, True) == loaded.factor(16, 1, True) == 0.9


def test_a_shape_learnt_later_in_a_run_starts_from_the_runs_average():
    c = Corrections()
    for _ in range(4):
        c.observe(16, 1, True, predicted=0.010, seconds=0.010)
    c.observe(8, 1, True, predicted=0.010, seconds=0.500)  # (warm-up)
    c.observe(8, 1, True, predicted=0.010, seconds=0.500)  # a stall in its first timed cycle: no 50x factor
    assert c.factor(8, 1, True) == pytest.approx(MAX_STEP)


def test_a_short_draft_blocks_cycles_are_a_shape_of_their_own():
    """A draft of 4 positions saves what the profile says, but its cycle runs on a tree's path (a host read, a plan,
    a masked verify) where the whole block's may run on the chain's: on MLX the two cost the same wall time where
    the profile priced the short one 3.6 ms cheaper. Sharing a factor, the short block kept that advantage."""
    c = Corrections()
    for _ in range(20):
        c.observe(16, 1, True, predicted=0.019, seconds=0.018)
        c.observe(16, 1, True, predicted=0.015, seconds=0.018, block=4)
    assert c.factor(16, 1, True) < 1.0 < 1.15 < c.factor(16, 1, True, block=4)
    assert Corrections.key(16, 1, True, 4) == "draft:1x16@4"
