"""dflash.core.budget.ChainBudget: the length of a rejection chain under --verify auto, from acceptance measured under the
rule in use and the device's costs."""

from dflash.core.budget import ChainBudget, Costs, CycleClock, TreePlanner

# a CPU-like device: a verify of n tokens costs 1 + 0.25 (n - 1) target steps, a draft forward 0.5
CPU = Costs(draft=0.5, verify=[(1, 1.0), (16, 4.75)])


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
    assert budget.length(can_pause=False) >= 1  # a caller that must draft gets a length


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


def test_costs_grow_with_the_batch_context_between_the_two_profiles():
    near = Costs(draft=0.5, verify=[(1, 1.0), (16, 4.0)], context=64)
    near.longer = Costs(draft=0.7, verify=[(1, 2.0), (16, 6.0)], context=320)
    assert near.verify_seconds(1) == near.verify_seconds(1, context=10) == 1.0  # flat below the short profile
    assert near.verify_seconds(1, context=192) == 1.5  # halfway
    assert near.verify_seconds(16, context=576) == 8.0  # linear past the longer one
    assert abs(near.draft_seconds(context=320) - 0.7) < 1e-9
    assert Costs.from_json(near.to_json()) == near  # the cache file holds both


def test_a_row_whose_drafts_fail_is_not_slowed_by_the_others_trees():
    """Two rows, one whose drafts the calibration trusts and one whose it does not, on the CPU-like device: a plain
    step of two rows costs 1.25, the draft forward alone 1.0, so any drafted cycle makes the second row (expecting
    ~1 token) wait over 1.5 plain steps per token. Without a limit the first row's tree is taken for throughput;
    under the limit the cycle verifies the roots only and drafting pauses; and no whole-chain cycle is chosen."""
    def planned(itl_limit):
        planner = TreePlanner("auto", 4, 8, CPU, itl_limit=itl_limit)
        top_ids = [[[5, 6]] * 3, [[7, 8]] * 3]
        top_probs = [[[0.99, 0.01]] * 3, [[0.02, 0.01]] * 3]
        return planner, planner.plan([1, 2], top_ids, top_probs, copies=[[], []])

    unlimited, plan = planned(None)
    assert len(plan.trees[0].tokens) > 1 and unlimited.chain_within
    limited, plan = planned(1.5)
    assert [len(t.tokens) for t in plan.trees] == [1, 1] and limited.skip > 0
    assert not limited.chain_within and limited.path() == "tree"


# a batch-heavy CPU: a draft forward fills every position of every row, so at 16 rows a block of 16 costs more than
# the verify it feeds, and a short block a quarter of it
HEAVY = Costs(draft=0.2, verify=[(1, 1.0), (64, 2.0)], batch={16: [(1, 1.0), (4, 2.0), (16, 5.0)]},
              draft_batch={16: 4.0}, draft_blocks={4: {1: 0.1, 16: 1.0}, 8: {1: 0.14, 16: 2.0},
                                                   16: {1: 0.2, 16: 4.0}})


def test_a_shorter_draft_costs_its_share_of_the_measured_blocks():
    assert HEAVY.draft_seconds(16) == 4.0 and HEAVY.draft_seconds(16, block=16) == 4.0
    assert HEAVY.draft_seconds(16, block=4) == 1.0 and abs(HEAVY.draft_seconds(16, block=6) - 1.5) < 1e-9
    assert abs(HEAVY.draft_seconds(1, block=8) - 0.14) < 1e-9
    assert HEAVY.cycle_seconds(4, 16, True, block=4) == 2.0 + 1.0
    assert Costs(draft=0.5, verify=[(1, 1.0)]).draft_seconds(block=4) == 0.5  # no block points: the whole block
    assert Costs.from_json(HEAVY.to_json()) == HEAVY


def _confident_chain(rows: int, depth: int = 15, k: int = 2):
    """rows drafts whose rank-1 proposal is almost surely right at every depth."""
    return [[list(range(3, 3 + k))] * depth] * rows, [[[0.9] + [0.05] * (k - 1)] * depth] * rows


def test_auto_drafts_a_short_block_where_the_draft_forward_is_most_of_the_cycle():
    planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    assert planner.blocks == [4, 8, 16] and planner.draft_block == 16
    blocks = []
    for _ in range(60):  # every cycle drafts the block chosen after the last one
        blocks.append(planner.plan([0] * 16, *_confident_chain(16, planner.draft_block - 1)).block)
        planner.skip = 0
    # 16 rows: a draft of 16 positions does not pay; it is tried again ever more rarely
    assert blocks[:3] == [16, 4, 8] and blocks[-20:].count(16) <= 1 and planner.draft_block < 16
    assert planner.path() == "tree"  # (the chain's own path drafts the whole block)
    single = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    for _ in range(12):
        single.plan([0], *_confident_chain(1, single.draft_block - 1))
    assert single.draft_block == 16  # one row: the whole block costs little more than a short one


def test_a_plan_that_reaches_the_short_blocks_end_tries_the_next_one_up():
    planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    planner.draft_block = planner.drafted_block = 4
    planner.plan([0] * 16, *_confident_chain(16, 3))  # every row's chain uses all 3 positions
    assert planner.draft_block == 8


def test_a_rejection_chain_drafts_only_the_positions_it_verifies():
    budget = ChainBudget(16, HEAVY)
    assert budget.forwards(3, rows=16) == HEAVY.verify_seconds(4, 16) + 1.0  # the draft of 4 positions
