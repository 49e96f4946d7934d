"""dflash.core.path_choice: auto's chain-or-tree choice from estimates, with rare probes of the path not in use."""

from dflash.core.budget import TreePlanner
from dflash.core.cycle_times import CycleTimes
from dflash.core.path_choice import PROBE_LAST, PathChoice


def test_the_faster_path_is_kept_and_the_other_probed_ever_more_rarely():
    costs = CycleTimes.fixed(plain=1.0, token=0.2 / 15, draft=1.0)
    planner = TreePlanner("auto", 4, 8, costs)
    model = costs.cycle_seconds(4)
    seen = []
    for _ in range(3000):  # tree cycles take twice the chain's seconds and commit a third more: the chain wins
        path = planner.path()
        seen.append(path)
        if path == "tree":
            planner.choice.tokens = [4.0, 3.0]
        planner.observe_speed(path, [1], 2 * model if path == "tree" else model)
    warmup = planner.choice.warmup
    assert seen[:2 * warmup] == ["tree"] * warmup + ["chain"] * warmup  # each path's first cycles, then estimates
    probes = [i for i, path in enumerate(seen) if path == "tree" and i >= 2 * warmup]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0]  # the tree is probed ever more rarely
    assert max(gaps) <= PROBE_LAST + 1 and planner.choice.wait == PROBE_LAST  # ... but within a bounded wait
    assert seen.count("chain") > 0.99 * len(seen)  # the faster path is the one followed
    assert TreePlanner("tree", 4, 8).path() == "tree"


def test_each_drafted_plan_says_what_its_trees_and_the_chain_are_expected_to_commit():
    """From the same calibration: the chosen nodes' values for the tree; for the chain, the drafter's rank-1 node at
    every depth (whether or not the tree keeps them), valued the way the tree's nodes are."""
    planner = TreePlanner("auto", 4, 8, CycleTimes.fixed(plain=1.0, token=0, draft=0.0), copy_branch=False)
    plan = planner.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])
    tree, chain = planner.choice.tokens
    nodes = plan.trees[0]
    assert tree == 1.0 + sum(nodes.values[1:])
    scale = planner.calibration.scale
    assert chain == 1.0 + 0.6 * scale(1) + 0.36 * scale(2) + 0.216 * scale(3)
    assert len(nodes.tokens) == 7 and tree > chain  # six nodes keep the whole chain and branch besides it
    planner.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])
    assert planner.choice.tokens[1] == planner.choice.decay * chain + chain  # decaying sums
    fixed = TreePlanner("tree", 4, 8)
    fixed.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])
    assert fixed.choice.tokens == [0.0, 0.0]  # (a fixed mode chooses nothing)


def test_auto_enumerates_twice_the_nodes_it_last_verified():
    costs = CycleTimes.fixed(plain=1.0, token=0, draft=0.0)  # verifying is free: every candidate is taken
    planner = TreePlanner("auto", 4, 100, costs, copy_branch=False)
    assert planner.reach == 6
    top_ids, top_probs = [[list(range(8))] * 3], [[[0.125] * 8] * 3]
    assert len(planner.plan([0], top_ids, top_probs).trees[0].tokens) == 1 + 6
    assert planner.reach == 12
    assert len(planner.plan([0], top_ids, top_probs).trees[0].tokens) == 1 + 12
    assert len(TreePlanner("tree", 4, 100).plan([0], top_ids, top_probs).trees[0].tokens) == 1 + 100


def test_the_gain_is_the_ratio_of_expected_tokens_per_predicted_second():
    choice = PathChoice(decay=1.0)
    choice.observe_plan([8.0], [8.0], (2.0, 2.0))  # an easy stretch: both commit 8, the tree is the chain's shape
    choice.observe_plan([3.0], [1.0], (1.0, 2.0))  # a hard one: the tree 3 in a cycle half the chain's
    choice.factor = {"chain": 1.0, "tree": 1.1}
    assert abs(choice.ratio() - (11 / 3) / (9 / 4) / 1.1) < 1e-12


def test_a_tree_cycle_is_timed_against_its_own_width():
    """The tree path's factor is its overhead over the cost model at the tree's width: a small tree's cycle is not
    counted as a cheap chain cycle, and a tree that is the chain is not costed as the chain's path is."""
    costs = CycleTimes.fixed(plain=1.0, token=1 / 15, draft=1.0)
    planner = TreePlanner("auto", 4, 8, costs, copy_branch=False)
    planner.plan([0], [[[5], [6], [7]]], [[[0.9], [0.01], [0.01]]])  # deep nodes not worth their verify tokens
    width = planner.planned_width
    assert width < 4  # (a chain verifies 4)
    model = costs.cycle_seconds(width, 1, True)
    for _ in range(2):  # (the first cycle of a path only warms up)
        planner.observe_speed("tree", [1], 1.2 * model)
    assert abs(planner.choice.factor["tree"] - 1.2) < 1e-9


def test_a_chain_that_is_the_copied_branch_is_valued_as_the_tree_of_the_same_nodes():
    """Where the drafter's rank-1 proposals are the branch copied from the context, the chain verifies the tree's
    nodes: both are expected to commit the same (before, the chain's q alone made it look worse, and auto kept the
    tree's slower path on text that the chain committed whole)."""
    planner = TreePlanner("auto", 4, 3, CycleTimes.fixed(plain=1.0, token=0, draft=0.0))
    for d in range(1, 4):  # copies of this context have been accepted
        planner.calibration.copy_offered[d] = planner.calibration.copy_accepted[d] = 50
    planner.plan([0], [[[5, 6], [7, 6], [8, 6]]], [[[0.4, 0.3]] * 3], copies=[[5, 7, 8]])
    tree, chain = planner.choice.tokens
    assert chain == tree > 3.5


def test_a_short_blocks_plan_says_nothing_of_the_chain():
    planner = TreePlanner("auto", 16, 16, CycleTimes.fixed(plain=1.0, token=0.2 / 15, draft=1.0), copy_branch=False)
    planner.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])  # a draft of 4 positions: 3 proposals
    assert planner.choice.tokens == [0.0, 0.0]


def test_a_shorter_block_must_beat_the_chains_path_where_that_is_faster():
    """The copied branch holds the whole chain, so a draft of 8 positions loses no node and saves 10% of a cycle by
    the profile; its cycles run on a tree's path. Once the chain's path is measured 25% faster than the tree's at the
    whole block, the whole block is kept."""
    costs = CycleTimes.fixed(plain=1.0, token=0.0, draft=0.3)
    confident = [[[5, 6]] * 15], [[[0.9, 0.1]] * 15]

    def next_block(chain_factor):
        planner = TreePlanner("auto", 16, 16, costs, itl_limit=None)
        planner.blocks = [8, 16]  # (the shorter blocks would save more still)
        calibration, choice = planner.calibration, planner.choice
        for d in range(1, 16):
            calibration.copy_offered[d] = calibration.copy_accepted[d] = 1000
        choice.cycles, choice.factor = {"chain": 9, "tree": 9}, {"chain": chain_factor, "tree": 1.0}
        choice.tokens, choice.seconds = [15.0, 15.0], [1.3, 1.3]
        for _ in range(8):
            planner.plan([0], *confident, copies=[[5] * 15])
            if planner.draft_block < 16:
                return planner.draft_block
        return planner.draft_block

    assert next_block(1.0) == 8 and next_block(0.8) == 16
