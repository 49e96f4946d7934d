"""dflash.core.path_choice: auto's chain-or-tree choice from estimates, with rare probes of the path not in use."""

from dflash.core.budget import Costs, TreePlanner
from dflash.core.path_choice import PROBE_LAST, PathChoice


def test_the_faster_path_is_kept_and_the_other_probed_ever_more_rarely():
    costs = Costs(draft=1.0, verify=[(1, 1.0), (16, 1.2)])
    planner = TreePlanner("auto", 4, 8, costs)
    model = costs.draft_seconds(1) + costs.verify_seconds(4)
    seen = []
    for _ in range(3000):  # tree cycles take twice the chain's seconds and commit a third more: the chain wins
        path = planner.path()
        seen.append(path)
        if path == "tree":
            planner.choice.tokens = [4.0, 3.0]
        planner.observe_speed(path, [1], 2 * model if path == "tree" else model)
    assert seen[:3] == ["tree"] * 3 and seen[3:6] == ["chain"] * 3  # each path's first cycles, then estimates
    late = seen[100:]
    assert 0 < late.count("tree") <= 8  # probes after 16, 32, 64 .. 1024 cycles while the chain wins clearly
    assert planner.choice.wait == PROBE_LAST
    assert TreePlanner("tree", 4, 8).path() == "tree"


def test_a_tree_cycle_tells_what_the_chain_would_have_committed():
    """The chain accepts the accepted path's leading rank-1 nodes; past the tree's rank-1 nodes, its expected
    continuation comes from the per-depth rates."""
    planner = TreePlanner("auto", 4, 8, Costs(draft=0.0, verify=[(1, 1.0), (512, 1.0)]), copy_branch=False)
    plan = planner.plan([0], [[[5, 6]] * 3], [[[0.6, 0.4]] * 3])
    tree, flags = plan.trees[0], plan.on_chain[0]
    rank1 = [i for i in range(1, len(tree.tokens)) if flags[i]]
    assert [tree.tokens[i] for i in rank1] == [5, 5, 5]
    off = next(i for i in range(1, len(tree.tokens)) if tree.depths[i] == 1 and tree.tokens[i] == 6)
    for path, chain in (([off], 1.0), (rank1[:1], 2.0), (rank1, 4.0)):
        choice = PathChoice(4)
        choice.observe_tree([flags], [path])
        assert choice.tokens == [1.0 + len(path), chain]
    choice = PathChoice(4, prior=0.5)
    choice.observe_tree([[True, True]], [[1]])  # one rank-1 node verified and accepted: the rest is expected
    assert choice.tokens[1] == 2.0 + choice.rates[1] + choice.rates[1] * choice.rates[2]


def test_chain_rates_are_learnt_from_chain_cycles():
    choice = PathChoice(4)
    for _ in range(200):
        choice.observe_chain([1], verified=3)  # the first proposal always accepted, the second never
    assert choice.rates[0] > 0.99 and choice.rates[1] < 0.01 and choice.rates[2] == 0.5  # (depth 3 never reached)
    assert choice.continuation(1) < 0.01
