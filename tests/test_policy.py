"""dflash/core/policy.py: the length of a rejection chain under --verify auto (ChainBudget), from acceptance
measured under the rule in use and the device's costs."""

import pytest

from dflash.core.policy import ChainBudget
from dflash.core.cycle_times import CycleTimes
from cycle_devices import CPU, HEAVY


def test_length_follows_the_acceptance_measured():
    budget = ChainBudget(16, CPU)
    for _ in range(200):  # every proposal accepted
        budget.observe(15, [15], 1.0 + 0.25 * 15 + 0.5)
    budget.observe(0, [0], 1.0)  # (a plain step is timed every PLAIN_EVERY drafted cycles)
    assert budget.length() == 15
    for _ in range(200):  # the first proposal accepted half the time, the second never
        budget.observe(15, [0], 5.25)
        budget.observe(15, [1], 5.25)
    assert budget.rates[0] > 0.4 and budget.rates[1] < 0.1
    assert budget.best() == 1


def test_a_drafter_that_is_never_right_pauses_with_backoff():
    budget = ChainBudget(16, CPU)
    lengths = []
    for _ in range(60):  # the device's cycles: a drafted one costs its forwards, nothing is ever accepted
        n = budget.length()
        budget.observe(n, [0], CPU.cycle_seconds(n + 1, 1, n > 0, n + 1))
        lengths.append(n)
    assert lengths.count(0) > 45  # mostly plain steps ...
    assert 0 < sum(n > 0 for n in lengths[20:]) < 6  # ... with probes between growing pauses
    assert budget.best() == 1  # (the chain a cycle that must draft verifies: the shortest)


def test_a_text_that_turns_easy_is_drafted_again_within_a_few_pauses():
    """Nothing accepted for 150 cycles (the pauses grow to 64), then every proposal: probes that win shorten the
    pauses, so the budget drafts again long before rates smoothed over rare probes would say so."""
    budget = ChainBudget(16, CPU)
    lengths = []
    for cycle in range(400):
        n = budget.length()
        easy = cycle >= 150
        budget.observe(n, [n if easy else 0], CPU.cycle_seconds(n + 1, 1, n > 0, n + 1))
        lengths.append(n)
    assert lengths[100:150].count(0) > 45  # (the hard stretch: long pauses)
    assert sum(n > 0 for n in lengths[-100:]) > 90


def test_a_new_request_drafts_its_first_cycle_and_keeps_the_pause_length():
    budget = ChainBudget(16, CPU)
    for _ in range(200):  # never accepted: long pauses
        n = budget.length()
        budget.observe(n, [0], CPU.cycle_seconds(n + 1, 1, n > 0, n + 1))
    backoff = budget.pause.backoff
    budget.reset()
    n = budget.length()
    assert n > 0
    budget.observe(n, [0], CPU.cycle_seconds(n + 1, 1, True, n + 1))  # a losing probe: paused as long as before
    assert budget.length() == 0 and budget.pause.backoff >= backoff


def test_cycle_times_learnt_from_nothing_find_that_plain_steps_win():
    """Nothing known at first (the prior drafts); the cycles' own times and acceptance show plain steps win."""
    budget = ChainBudget(16, CycleTimes(16))
    for _ in range(200):
        n = budget.length()
        accepted = [min(n, 1)] if (_ % 10) < 2 else [0]  # position 1 accepted 20% of the time
        budget.observe(n, accepted, CPU.cycle_seconds(n + 1, 1, n > 0, n + 1))
    # real: one token per 1.0 plain, 1.2 tokens per 1.31 drafting one position: plain steps win
    assert budget.length() == 0


def test_a_rejection_chain_drafts_only_the_positions_it_verifies():
    budget = ChainBudget(16, HEAVY)
    # the draft of 4 positions for 16 rows: a quarter of the whole block's 16 x 0.25
    seconds = budget.expected(3) / budget.rate(3, rows=16)
    assert seconds == pytest.approx(HEAVY.cycle_seconds(4, 16, False) + 1.0)
