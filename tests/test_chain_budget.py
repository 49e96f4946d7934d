"""dflash/core/chain_budget.py: the length of a rejection chain under --verify auto, from acceptance measured under the
rule in use and the device's costs."""

from dflash.core.chain_budget import ChainBudget
from dflash.core.cost_model import Costs
from test_cost_model import CPU, HEAVY


def test_length_follows_the_acceptance_measured():
    budget = ChainBudget(16, CPU)
    for _ in range(200):  # every proposal accepted
        budget.observe(15, [15], 1.0 + 0.25 * 15 + 0.5)
    budget.observe(0, [0], 1.0)  # (a plain step is timed every PLAIN_EVERY drafted cycles)
    assert budget.length(can_pause=True) == 15
    for _ in range(200):  # the first proposal accepted half the time, the second never
        budget.observe(15, [0], 5.25)
        budget.observe(15, [1], 5.25)
    assert budget.rates[0] > 0.4 and budget.rates[1] < 0.1
    assert budget.length(can_pause=False) == 1


def test_a_drafter_that_is_never_right_pauses_with_backoff():
    budget = ChainBudget(16, CPU)
    lengths = []
    for _ in range(60):  # the device's cycles: a drafted one costs its forwards, nothing is ever accepted
        n = budget.length(can_pause=True)
        budget.observe(n, [0], CPU.verify_seconds(n + 1) + (CPU.draft if n else 0.0))
        lengths.append(n)
    assert lengths.count(0) > 45  # mostly plain steps ...
    assert 0 < sum(n > 0 for n in lengths[20:]) < 6  # ... with probes between growing pauses
    assert budget.length(can_pause=False) == 1  # a caller that must draft gets the shortest chain


def test_a_text_that_turns_easy_is_drafted_again_within_a_few_pauses():
    """Nothing accepted for 150 cycles (the pauses grow to 64), then every proposal: probes that win shorten the
    pauses, so the budget drafts again long before rates smoothed over rare probes would say so."""
    budget = ChainBudget(16, CPU)
    lengths = []
    for cycle in range(400):
        n = budget.length(can_pause=True)
        easy = cycle >= 150
        budget.observe(n, [n if easy else 0], CPU.verify_seconds(n + 1) + (CPU.draft if n else 0.0))
        lengths.append(n)
    assert lengths[100:150].count(0) > 45  # (the hard stretch: long pauses)
    assert sum(n > 0 for n in lengths[-100:]) > 90


def test_a_new_request_drafts_its_first_cycle_and_keeps_the_pause_length():
    budget = ChainBudget(16, CPU)
    for _ in range(200):  # never accepted: long pauses
        n = budget.length(can_pause=True)
        budget.observe(n, [0], CPU.verify_seconds(n + 1) + (CPU.draft if n else 0.0))
    backoff = budget.backoff
    budget.reset()
    n = budget.length(can_pause=True)
    assert n > 0
    budget.observe(n, [0], CPU.verify_seconds(n + 1) + CPU.draft)  # a losing probe: paused as long as before
    assert budget.length(can_pause=True) == 0 and budget.backoff >= backoff


def test_a_stale_profile_is_corrected_by_the_cycles_own_times():
    """A profile measured on a busy machine (every forward twice its real time) first favours drafting; the plain
    steps timed now and then correct it."""
    busy = Costs(draft=1.0, verify=[(1, 2.0), (16, 9.5)])
    budget = ChainBudget(16, busy)
    for _ in range(200):
        n = budget.length(can_pause=True)
        accepted = [min(n, 1)] if (_ % 10) < 3 else [0]  # position 1 accepted 30% of the time
        budget.observe(n, accepted, CPU.verify_seconds(n + 1) + (CPU.draft if n else 0.0))
    # real: one token per 1.0 plain, 1.3 tokens per 1.75 drafted: plain steps win
    assert budget.length(can_pause=True) == 0


def test_a_rejection_chain_drafts_only_the_positions_it_verifies():
    budget = ChainBudget(16, HEAVY)
    assert budget.forwards(3, rows=16) == HEAVY.verify_seconds(4, 16) + 1.0  # the draft of 4 positions
