"""dflash.core.output: acceptance and cycle statistics as the CLIs report them."""

from dflash.core.output import cycle_counts


def test_cycle_counts_separate_undrafted_cycles_from_drafts_verifying_none():
    counts = cycle_counts([0, 4, 0, 2, 1], [False, True, True, True, False])
    assert (counts.cycles, counts.drafted, counts.without_draft) == (5, 3, 2)
    assert counts.drafted_verifying_none == 1 and counts.verified_when_drafted == [4, 0, 2]
    assert cycle_counts([], []).drafted == 0
