"""dflash/core/cost_model.py: the device profile read at any rows, tokens, context and draft block, and the clock
from the profile's seconds to the wall clock's."""

import pytest

from dflash.core.cost_model import Costs, CycleClock

# a CPU-like device: a verify of n tokens costs 1 + 0.25 (n - 1) target steps, a draft forward 0.5
CPU = Costs(draft=0.5, verify=[(1, 1.0), (16, 4.75)])
# a batch-heavy CPU: a draft forward fills every position of every row, so at 16 rows a block of 16 costs more than
# the verify it feeds, and a short block a quarter of it
HEAVY = Costs(draft=0.2, verify=[(1, 1.0), (64, 2.0)], batch={16: [(1, 1.0), (4, 2.0), (16, 5.0)]},
              draft_batch={16: 4.0}, draft_blocks={4: {1: 0.1, 16: 1.0}, 8: {1: 0.14, 16: 2.0},
                                                   16: {1: 0.2, 16: 4.0}})


def test_costs_interpolate_and_extrapolate():
    c = Costs(0.1, [(1, 1.0), (3, 2.0), (5, 4.0)])
    assert c.verify_seconds(2) == 1.5 and c.verify_seconds(7) == 6.0 and c.verify_seconds(0) == 1.0
    assert Costs.from_json(c.to_json()) == c
    assert c.verify_seconds(2, rows=3) == c.verify_seconds(6) and c.draft_seconds(3) == pytest.approx(0.3)


def test_batch_costs_interpolate_over_rows_and_tokens():
    """Measured batches replace 'r rows of n tokens cost one row of r * n': a GPU-like device pays little per row."""
    c = Costs(0.1, [(1, 1.0), (16, 1.1), (64, 1.4)], batch={4: [(1, 1.05), (16, 1.3)], 16: [(1, 1.2), (16, 2.0)]},
              draft_batch={4: 0.12, 16: 0.2})
    assert c.verify_seconds(16, rows=1) == 1.1
    assert c.verify_seconds(16, rows=4) == 1.3 < c.verify_seconds(64)  # not one row of 64 tokens
    assert c.verify_seconds(16, rows=10) == pytest.approx(1.3 + 0.7 * 6 / 12)  # linear between measured rows
    assert c.verify_seconds(16, rows=32) == pytest.approx(2.0 + 0.7 * 16 / 12)  # and beyond the last two
    assert c.draft_seconds(2) == pytest.approx(0.1 + 0.02 / 3) and c.draft_seconds(16) == 0.2
    assert Costs.from_json(c.to_json()) == c


def test_the_cycle_clock_learns_a_scale_and_a_fixed_cost():
    """Cycles that really take 2x the profile + 3 ms, as rows come and go (1 .. 32): the fit recovers both, up to
    the ridge's small pull towards k = 1."""
    clock = CycleClock()
    for i in range(300):
        profile = 0.005 * (1 + (7 * i) % 32)
        clock.observe(profile, 2.0 * profile + 0.003)
    assert abs(clock.k - 2.0) < 0.06 and abs(clock.a - 0.003) < 0.004
    assert abs(clock(0.1) - 0.203) / 0.203 < 0.01  # (near the shapes seen, the prediction is close)


def test_one_shape_leaves_the_difference_to_the_fixed_cost():
    """A single row of one width: the slope cannot be told from the intercept, the ridge keeps k at its prior and
    the excess goes to a (the behaviour of a plain mean of the overhead)."""
    clock = CycleClock()
    for _ in range(200):
        clock.observe(0.010, 0.014)
    assert abs(clock.k - 1.0) < 0.1 and abs(clock(0.010) - 0.014) < 0.0005


def test_a_slope_stopped_at_zero_leaves_the_mean_of_the_cycles():
    """Steps run one ahead take their time unevenly: the cycle that issues the next one pays for most of it, and
    the one that takes it (one position later, a little dearer by the profile) almost nothing. The unconstrained
    slope is negative, k stops at 0, and the clock predicts the cycles' mean time, not the negative slope's
    intercept."""
    clock = CycleClock()
    for i in range(200):
        issues = i % 2 == 0
        clock.observe(0.050 if issues else 0.060, 0.110 if issues else 0.001)
    assert clock.k == 0.0 and abs(clock(0.055) - 0.0555) < 0.003


def test_costs_grow_with_the_batch_context_between_the_two_profiles():
    near = Costs(draft=0.5, verify=[(1, 1.0), (16, 4.0)], context=64)
    near.longer = Costs(draft=0.7, verify=[(1, 2.0), (16, 6.0)], context=320)
    assert near.verify_seconds(1) == near.verify_seconds(1, context=10) == 1.0  # flat below the short profile
    assert near.verify_seconds(1, context=192) == 1.5  # halfway
    assert near.verify_seconds(16, context=576) == 8.0  # linear past the longer one
    assert abs(near.draft_seconds(context=320) - 0.7) < 1e-9
    assert Costs.from_json(near.to_json()) == near  # the cache file holds both


def test_a_shorter_draft_costs_its_share_of_the_measured_blocks():
    assert HEAVY.draft_seconds(16) == 4.0 and HEAVY.draft_seconds(16, block=16) == 4.0
    assert HEAVY.draft_seconds(16, block=4) == 1.0 and abs(HEAVY.draft_seconds(16, block=6) - 1.5) < 1e-9
    assert abs(HEAVY.draft_seconds(1, block=8) - 0.14) < 1e-9
    assert HEAVY.cycle_seconds(4, 16, True, block=4) == 2.0 + 1.0
    assert Costs(draft=0.5, verify=[(1, 1.0)]).draft_seconds(block=4) == 0.5  # no block points: the whole block
    assert Costs.from_json(HEAVY.to_json()) == HEAVY
