"""dflash.core.stats: acceptance and cycle statistics as the CLIs report them."""

from dflash.core.stats import cycle_counts, measured_speedup


def test_cycle_counts_separate_undrafted_cycles_from_drafts_verifying_none():
    counts = cycle_counts([0, 4, 0, 2, 1], [False, True, True, True, False])
    assert (counts.cycles, counts.drafted, counts.without_draft) == (5, 3, 2)
    assert counts.drafted_verifying_none == 1 and counts.verified_when_drafted == [4, 0, 2]
    assert cycle_counts([], []).drafted == 0


def test_measured_speedup_is_bounded_by_tau():
    assert measured_speedup(0.010, 0.005, tau=3.0) == 2.0
    assert measured_speedup(0.0131, 0.010, tau=1.0) is None  # no draft accepted: 1.31x cannot be
    assert measured_speedup(0.0, 0.010, tau=2.0) is None
