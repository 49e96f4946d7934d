"""dflash.budget.ChainBudget: the length of a rejection chain under --verify auto, from acceptance measured under the
rule in use and the device's costs."""

from dflash.budget import ChainBudget, Costs

# a CPU-like device: a verify of n tokens costs 1 + 0.25 (n - 1) target steps, a draft forward 0.5
CPU = Costs(draft=0.5, verify=[(1, 1.0), (16, 4.75)])


def test_length_follows_the_acceptance_measured():
    budget = ChainBudget(16, CPU)
    for _ in range(200):  # every proposal accepted
        budget.observe(15, [15], 1.0 + 0.25 * 15 + 0.5)
    assert budget.length(can_pause=True) == 15
    for _ in range(200):  # the first proposal accepted half the time, the second never
        budget.observe(15, [0], 5.25)
        budget.observe(15, [1], 5.25)
    assert budget.rates[0] > 0.4 and budget.rates[1] < 0.1
    assert budget.length(can_pause=False) == 1


def test_a_drafter_that_is_never_right_pauses_with_backoff():
    budget = ChainBudget(16, CPU)
    for _ in range(100):
        budget.observe(1, [0], 1.75)
    lengths = [budget.length(can_pause=True) for _ in range(40)]
    assert lengths[0] == 0 and lengths.count(0) > 30  # mostly plain steps ...
    assert any(n > 0 for n in lengths)  # ... with probes between growing pauses
    assert budget.length(can_pause=False) >= 1  # a batch always drafts (its rows' features cannot wait apart)
