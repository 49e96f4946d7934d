"""dflash/core/budget.py: the tree planner of --verify auto under a latency limit, with draft blocks shorter than the
drafter's, and its choice between the chain's path and a tree's (the plan's node counts are tests/test_tree.py's)."""

from dflash.core.budget import BATCH_PAUSE, MAX_PAUSE, Pause, TreePlanner
from dflash.core.cycle_times import CycleTimes
from dflash.core.tree import chain_value
from cycle_devices import HEAVY, FixedTimes, cpu


def test_a_row_whose_drafts_fail_is_not_slowed_by_the_others_trees():
    """Two rows, one whose drafts the calibration trusts and one whose it does not, on the CPU-like device: a plain
    step of two rows costs 1.25, the draft forward alone 1.0, so any drafted cycle makes the second row (expecting
    ~1 token) wait over 1.5 plain steps per token. Without a limit the first row's tree is taken for throughput;
    under the limit the cycle verifies the roots only and drafting pauses; and no whole-chain cycle is chosen."""
    def planned(itl_limit):
        planner = TreePlanner("auto", 4, 8, cpu(4), itl_limit=itl_limit)
        top_ids = [[[5, 6]] * 3, [[7, 8]] * 3]
        top_probs = [[[0.99, 0.01]] * 3, [[0.02, 0.01]] * 3]
        return planner, planner.plan([1, 2], top_ids, top_probs, copies=[[], []])

    unlimited, plan = planned(None)
    assert len(plan.trees[0].tokens) > 1 and unlimited.chain_within
    limited, plan = planned(1.5)
    assert [len(t.tokens) for t in plan.trees] == [1, 1] and limited.pause.skip > 0
    limited.pause = Pause()  # (a pause runs the tree's path too)
    assert not limited.chain_within and {limited.path() for _ in range(200)} == {"tree"}  # (no chain probe either)


def _confident_chain(rows: int, depth: int = 15, k: int = 2):
    """rows drafts whose rank-1 proposal is almost surely right at every depth."""
    return [[list(range(3, 3 + k))] * depth] * rows, [[[0.9] + [0.05] * (k - 1)] * depth] * rows


def test_auto_drafts_a_short_block_where_the_draft_forward_is_most_of_the_cycle():
    planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    assert planner.blocks == [2, 4, 8, 16] and planner.draft_block == 16
    blocks = []
    for _ in range(60):  # every cycle drafts the block chosen after the last one
        blocks.append(planner.plan([0] * 16, *_confident_chain(16, planner.draft_block - 1)).block)
        planner.pause.skip = 0
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

def test_one_row_that_accepts_its_short_blocks_last_drafted_node_drafts_the_next_block_up_at_once():
    """A short block carried over from earlier texts is left as soon as the target accepts everything it drafted (one
    row): on MLX the q-based values had kept auto at block 8 on a text the chain committed 8.9 tokens a cycle of."""
    def after(rows: int, copied: bool = False, depth: int = 3) -> int:
        planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=copied, itl_limit=None)
        planner.draft_block = planner.drafted_block = 4
        ids, probs = _confident_chain(rows, 3)
        plan = planner.plan([0] * rows, ids, probs, copies=[[3, 3, 3]] * rows if copied else ())
        planner.draft_block = 4  # (whatever the plan's rates chose: the cycle's outcome decides here)
        tree = plan.trees[0]
        path = [i for i in range(1, len(tree.tokens)) if tree.depths[i] <= depth and tree.tokens[i] == 3]
        if copied:  # (the copied branch's nodes alone)
            for qs in plan.qs:
                qs[1:] = [0.0] * (len(qs) - 1)
        planner.observe(plan, [path] * rows)
        return planner.draft_block

    assert after(1) == 8
    assert after(1, depth=2) == 4  # (the block's last node was not reached)
    assert after(1, copied=True) == 4  # (the copied branch reached it, not the drafter)
    assert after(2) == 4  # (a batch's short block is its cost's choice)


def test_a_row_given_no_drafted_node_leaves_the_draft_forward_for_longer_each_time():
    planner = TreePlanner("auto", 16, 64, HEAVY)
    drafting = planner.drafting_rows
    pauses = [Pause() for _ in range(3)]
    assert drafting(pauses) == [0, 1, 2]
    seen = []
    for _ in range(12):  # row 1's plans never give it a drafted node; rows 0 and 2 always get one
        rows = drafting(pauses)
        seen.append(1 in rows)
        for r in rows:
            pauses[r].observe(drafting_wins=r != 1)
    # pauses of 1, 2, 4 drafted cycles, each ended by a probe
    assert seen == [True, False, True, False, False, True, False, False, False, False, True, False]
    pauses[1].observe(drafting_wins=True)  # a probe that pays ends the pause
    assert pauses[1].backoff == 0
    pauses[2].observe(drafting_wins=False)
    pauses = [pauses[2], pauses[0], Pause()]  # row 1 leaves, the others move up, a row joins: each its own pause
    assert [p.skip for p in pauses] == [1, 0, 0] and drafting(pauses) == [1, 2]


def test_a_plan_of_some_rows_prices_the_draft_forward_of_those_rows():
    """Rows 0 and 1 draft, rows 2 and 3 sit out: their trees are roots only, the draft forward is priced at two rows
    (on the batch-heavy CPU a draft of 16 rows costs 4 plain steps, of 2 rows half a step), and the chain's own
    path, which drafts every row, is not taken."""
    confident, weak = ([[5, 6]] * 15, [[0.9, 0.05]] * 15), ([[7, 8]] * 15, [[0.02, 0.01]] * 15)
    planner = TreePlanner("auto", 16, 64, FixedTimes(plain=1.0, token=0.3 / 511, draft=0.3), itl_limit=None)
    assert planner.drafting_rows([Pause()]) is None  # (one row: the batch's own pause)
    pauses = [Pause(skip=s) for s in (0, 0, 3, 3)]
    assert planner.drafting_rows(pauses) == [0, 1]
    plan = planner.plan([1, 2, 3, 4], [confident[0]] * 2, [confident[1]] * 2, drafting=[0, 1], pauses=pauses)
    assert plan.draft_rows == 2 and [len(t.tokens) > 1 for t in plan.trees] == [True, True, False, False]
    assert planner.path(pauses) == "tree"

    def drafted_rate(drafting):
        planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
        ids, probs = zip(*([confident] * 2 + [weak] * (14 if drafting is None else 0)))
        planner.plan([0] * 16, list(ids), list(probs), drafting=drafting, pauses=[Pause() for _ in range(16)])
        return planner.rates[16]

    assert drafted_rate([0, 1]) > 1.25 * drafted_rate(None)  # (12.3 against 9.2 tokens per unit of time)


def test_a_plan_that_gives_no_row_a_drafted_node_pauses_the_batch_not_every_row():
    weak = ([[7, 8]] * 15, [[0.02, 0.01]] * 15)
    planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    pauses = [Pause() for _ in range(4)]
    assert planner.drafting_rows(pauses) == [0, 1, 2, 3]
    plan = planner.plan([0] * 4, [weak[0]] * 4, [weak[1]] * 4, drafting=[0, 1, 2, 3], pauses=pauses)
    assert all(len(t.tokens) == 1 for t in plan.trees) and planner.pause.skip > 0
    assert [p.skip for p in pauses] == [0, 0, 0, 0]  # (else a row would sit out the probe that ends the pause)


def test_a_new_request_probes_at_once_and_keeps_the_pauses_length():
    weak = ([[7, 8]] * 15, [[0.02, 0.01]] * 15)
    planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    for _ in range(5):  # drafting loses, again and again: a look, then pauses of 1, 2, 4, 8 cycles
        planner.plan([0], [weak[0]], [weak[1]])
        planner.pause.skip = 0
    backoff = planner.pause.backoff
    planner.pause.skip = backoff
    planner.reset()
    assert planner.drafts_this_cycle() and planner.pause.backoff == backoff
    planner.plan([0], [weak[0]], [weak[1]])  # the request's first look loses: one cycle, then another look
    assert planner.pause.skip == 1 and planner.pause.backoff == backoff
    planner.pause.skip = 0
    planner.plan([0], [weak[0]], [weak[1]])  # that one loses too: the next pause is longer still, not 1
    assert planner.pause.skip == 2 * backoff


def test_after_the_longest_pause_a_new_requests_losing_first_look_pauses_at_once():
    """A drafter whose every probe of the last text lost (pauses grown to BATCH_PAUSE) gets one look at a new text, not
    two: a look that loses pauses for the longest pause again (an untrained drafter's second look was a third of
    its probes, each a draft forward and a host read for a plan with no node)."""
    weak = ([[7, 8]] * 15, [[0.02, 0.01]] * 15)
    planner = TreePlanner("auto", 16, 64, HEAVY, copy_branch=False, itl_limit=None)
    while planner.pause.backoff < BATCH_PAUSE:
        planner.plan([0], [weak[0]], [weak[1]])
        planner.pause.skip = 0
    planner.reset()
    assert planner.drafts_this_cycle()
    planner.plan([0], [weak[0]], [weak[1]])
    assert planner.pause.skip == BATCH_PAUSE and planner.pause.backoff == BATCH_PAUSE


def test_a_probes_time_is_not_learnt_and_a_new_request_forgets_the_last_ones_rates():
    """The cycle that ends a pause also reads every position the pause committed: its time must not become the
    drafted cycles' cost. And a request's drafts are judged on their own text, not outvoted by the last one's."""
    confident = ([[[5, 6]] * 15], [[[0.9, 0.05]] * 15])  # one row
    times = CycleTimes(16)
    planner = TreePlanner("auto", 16, 64, times, copy_branch=False, itl_limit=None)
    planner.observe_plain(1, 1.0)  # a paused cycle
    plan = planner.plan([0], *confident)
    planner.observe(plan, [[]], seconds=50.0)  # the probe: 50x its shape's cost
    assert times.observed == 1
    for _ in range(3):  # the next drafted cycles are learnt
        planner.observe(planner.plan([0], *confident), [[]], seconds=1.3)
    assert times.observed == 4
    planner.rates.update({16: 0.1, "plain": 10.0})  # the last request's: drafting lost by far
    planner.reset()
    assert not planner.rates


def test_a_drafted_node_on_the_copied_branch_counts_for_trying_the_next_block_up():
    """A draft of 4 positions whose proposals are also the copied branch's reaches its last position: the next draft
    tries 8 (counted as copied nodes only, such plans never did, and the block stayed short for good)."""
    planner = TreePlanner("auto", 16, 64, HEAVY, itl_limit=None)
    planner.blocks = [4, 8, 16]  # (not 2, which this device's 16 rows would draft)
    planner.draft_block = planner.drafted_block = 4
    planner.plan([0] * 16, *_confident_chain(16, 3), copies=[[3] * 15] * 16)
    assert planner.draft_block == 8


def _cycle(planner, path, top_ids, top_probs, seconds):
    """One cycle on `path` of one row whose target accepts every rank-1 proposal, `seconds(tokens, path)` long."""
    if path == "chain":
        planner.observe_chain(1, seconds(planner.block_size, path))
        return
    plan = planner.plan([0], top_ids, top_probs)
    tree = plan.trees[0]
    chain = [i for i in range(1, len(tree.tokens)) if tree.tokens[i] == 5]  # (the rank-1 nodes: token 5 at each depth)
    planner.observe(plan, [chain], seconds(len(tree.tokens), path))


def test_the_faster_path_is_kept_and_the_other_probed_ever_more_rarely():
    """A tree's path costs a plain step more than the chain's at the same width (its host read): once measured, the
    chain's path runs, a tree cycle (which alone values the two) probing after 1, 2, 4 .. MAX_PAUSE of its cycles.
    Where the paths cost the same and a branching tree is expected to commit more, trees run, the chain probed."""
    costs = FixedTimes(plain=1.0, token=0.2 / 15, draft=0.2)
    for overhead, probs, best in ((1.0, [0.9, 0.1], "chain"), (0.0, [0.6, 0.4], "tree")):
        planner = TreePlanner("auto", 16, 32, costs, copy_branch=False)
        seen = []
        for _ in range(600):
            path = planner.path()
            seen.append(path)
            _cycle(planner, path, [[[5, 6]] * 15], [[probs] * 15],
                   lambda n, path: costs.cycle_seconds(n) + overhead * (path == "tree"))
        probes = [i for i, path in enumerate(seen) if path != best]
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert seen.count(best) > 0.95 * len(seen) and gaps[-3:] == [MAX_PAUSE + 1] * 3, (best, gaps)
        assert gaps[-8:] == sorted(gaps[-8:])  # (the first cycles may flip the path while they measure it)
    assert TreePlanner("tree", 4, 8).path() == "tree"


def test_each_drafted_plan_values_the_chain_from_the_trees_calibration():
    """The chain's tokens: the drafter's rank-1 node at every depth (whether or not the tree keeps them), valued as
    the tree's nodes are; its rate is those over the seconds of a chain cycle."""
    costs = FixedTimes(plain=1.0, token=0, draft=0.0)
    planner = TreePlanner("auto", 4, 8, costs, copy_branch=False)
    plan = planner.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])
    scale = planner.calibration.scale
    chain = 1.0 + 0.6 * scale(1) + 0.36 * scale(2) + 0.216 * scale(3)
    assert planner.rates["chain"] == chain / costs.cycle_seconds(4)  # (the paths' overheads alike, unmeasured)
    nodes = plan.trees[0]
    assert len(nodes.tokens) == 7 and 1.0 + sum(nodes.values[1:]) > chain  # six nodes keep the chain and branch
    fixed = TreePlanner("tree", 4, 8)
    fixed.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])
    assert fixed.rates == {}  # (a fixed mode chooses nothing)


def test_a_chain_that_is_the_copied_branch_is_valued_as_the_tree_of_the_same_nodes():
    """Where the drafter's rank-1 proposals are the branch copied from the context, the chain verifies the tree's
    nodes: both are expected to commit the same (valued by q alone, the chain looked worse, and auto kept the
    tree's slower path on text that the chain committed whole)."""
    planner = TreePlanner("auto", 4, 3, FixedTimes(plain=1.0, token=0, draft=0.0))
    for d in range(1, 4):  # copies of this context have been accepted
        planner.calibration.copy_offered[d] = planner.calibration.copy_accepted[d] = 50
    ids, probs = [[5, 6], [7, 6], [8, 6]], [[0.4, 0.3]] * 3
    plan = planner.plan([0], [ids], [probs], copies=[[5, 7, 8]])
    chain = chain_value(ids, probs, [5, 7, 8], planner.calibration)
    assert chain == 1.0 + sum(plan.trees[0].values[1:]) > 3.5


def test_a_short_blocks_plan_says_nothing_of_the_chain():
    planner = TreePlanner("auto", 16, 16, FixedTimes(plain=1.0, token=0.2 / 15, draft=1.0), copy_branch=False)
    planner.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])  # a draft of 4 positions: 3 proposals
    assert "chain" not in planner.rates and 4 in planner.rates


def test_a_shorter_block_must_beat_the_chains_path_where_that_is_faster():
    """The copied branch holds the whole chain, so a draft of 8 positions loses no node and saves 0.15 of a 1.3
    plain-step cycle; its cycles run on a tree's path. Where a tree's path costs 0.3 more, the chain's path at the
    whole block is faster, and is kept."""
    confident = [[[5, 6]] * 15], [[[0.9, 0.1]] * 15]

    def next_block(tree):
        planner = TreePlanner("auto", 16, 16, FixedTimes(plain=1.0, token=0.0, draft=0.3), itl_limit=None)
        planner.blocks = [8, 16]  # (the shorter blocks would save more still)
        planner.path_factor["tree"] = 1 + tree / 1.3  # (measured: a tree's path costs `tree` more at the block)
        for d in range(1, 16):
            planner.calibration.copy_offered[d] = planner.calibration.copy_accepted[d] = 1000
        for _ in range(8):
            planner.plan([0], *confident, copies=[[5] * 15])
            if planner.draft_block < 16:
                break
        return planner.draft_block, planner.best_path

    assert next_block(0.0)[0] == 8 and next_block(0.3) == (16, "chain")
