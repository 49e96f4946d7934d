"""dflash/core/tree.py and dflash/core/budget.py, pure: best-first order, masks, the walk, prompt lookup, the budget rule."""

import itertools
import math
import random

import pytest

from dflash.core.budget import TreePlanner
from dflash.core.tree import (Calibration, CopyIndex, Tree, TreeInputs, best_first, chain_tree, choose_counts,
                         merge_candidates, to_tree)

from cycle_devices import FixedTimes


def random_marginals(depth, k, seed):
    rng = random.Random(seed)
    ids, probs = [], []
    for _ in range(depth):
        p = sorted((rng.random() ** 3 for _ in range(k)), reverse=True)
        total = sum(p) * (1 + rng.random())  # the top-k holds part of the mass
        probs.append([x / total for x in p])
        ids.append(rng.sample(range(100), k))
    return ids, probs


@pytest.mark.parametrize("seed", range(5))
def test_best_first_is_the_n_most_probable_prefixes(seed):
    depth, k, n = 4, 3, 20
    ids, probs = random_marginals(depth, k, seed)
    got = best_first(ids, probs, n, depth)
    every = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            every.append(math.prod(probs[i][r] for i, r in enumerate(ranks)))
    every.sort(reverse=True)
    assert [round(c.q, 12) for c in got] == [round(q, 12) for q in every[:n]]
    seen = {()}
    for c in got:  # parents before children, tokens follow the ranks
        assert c.ranks[:-1] in seen
        seen.add(c.ranks)
        assert c.tokens == tuple(ids[i][r] for i, r in enumerate(c.ranks))


def test_best_first_respects_the_depth_limit():
    ids, probs = [[1, 2]] * 6, [[0.99, 0.01]] * 6
    assert max(len(c.tokens) for c in best_first(ids, probs, 50, 3)) == 3
    assert best_first(ids, probs, 0, 3) == []


def test_chain_is_the_rank_one_special_case():
    ids, probs = [[5, 6]] * 4, [[0.9, 0.1]] * 4
    chain = best_first(ids, probs, 4, 4)
    assert [c.ranks for c in chain] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    tree = to_tree(7, merge_candidates(chain, [], Calibration(4)))
    assert tree.tokens == chain_tree(7, [5, 5, 5, 5]).tokens and tree.parents == [-1, 0, 1, 2, 3]


def test_mask_paths_and_walk():
    # root 0 -> a(1) -> c(3); root -> b(2) -> d(4)
    t = Tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [1, .5, .4, .3, .2], [False] * 5)
    assert t.mask() == [[True, False, False, False, False], [True, True, False, False, False],
                        [True, False, True, False, False], [True, True, False, True, False],
                        [True, False, True, False, True]]
    assert t.paths() == [[9], [9, 1], [9, 2], [9, 1, 3], [9, 2, 4]]
    # the target's token at each node: root says 2 (second child), node 2 says 4 (its child), node 4 says 7
    assert t.walk([2, 0, 4, 0, 7]) == ([2, 4], 7)
    assert t.walk([5, 0, 0, 0, 0]) == ([], 5)  # no child matches: the bonus token alone
    assert t.walk([1, 3, 0, 8, 0]) == ([1, 3], 8)


def test_tree_inputs_pad_rows_to_the_widest():
    a, b = chain_tree(1, [2, 3]), Tree.root(4)
    inputs = TreeInputs.of([a, b])
    assert inputs.width == 3 and inputs.ids[1].tolist() == [4, 4, 4]
    assert inputs.real[1].tolist() == [True, False, False]
    assert inputs.allowed[1, 2].tolist() == [False, False, True]  # padding sees only itself
    assert inputs.allowed[0].tolist() == chain_tree(1, [2, 3]).mask()
    assert inputs.depths[0].tolist() == [0, 1, 2]
    assert inputs.paths == [[[1], [1, 2], [1, 2, 3]], [[4], [4], [4]]]  # padding: the root's history
    t = Tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [1, .5, .4, .3, .2], [False] * 5)
    assert TreeInputs.of([t]).allowed[0].tolist() == t.mask()


def test_copy_index_finds_the_latest_longest_match():
    idx = CopyIndex(max_ngram=3)
    idx.update([1, 2, 3, 4, 1, 2, 3, 9, 1, 2])
    assert idx.continuation(3) == [3, 9, 1]  # (1, 2) last occurred before 3, 9
    idx.update([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3])
    assert idx.continuation(2) == [9, 1]  # (1, 2, 3) latest at position 4..6
    idx.update([5, 6])  # another sequence: starts over
    assert idx.continuation(4) == []


def test_copy_index_continues_a_loop_past_the_sequences_end():
    """Text that repeats with period p: the continuation copies itself, as the loop would go on."""
    idx = CopyIndex(max_ngram=3)
    loop = [7, 8, 9]
    idx.update([1, 2] + loop * 3)
    assert idx.continuation(8) == (loop * 3)[:8]  # (7, 8, 9) latest 3 back: 3 tokens seen, 5 more of the loop
    idx.update([1, 2, 3, 4, 1, 2, 3, 9, 1, 2])
    assert idx.continuation(6) == [3, 9, 1, 2, 3, 9]  # (1, 2) 4 back: 3, 9, 1, 2, then again


def test_copied_branch_joins_the_tree_and_orphans_are_never_chosen():
    ids, probs = [[5, 6], [7, 8], [1, 2]], [[0.6, 0.3], [0.5, 0.4], [0.9, 0.1]]
    draft = best_first(ids, probs, 3, 3)
    merged = merge_candidates(draft, [6, 9, 9], Calibration(3))
    prefixes = [c.tokens for c in merged]
    assert (6,) in prefixes and (6, 9) in prefixes and (6, 9, 9) in prefixes
    assert [c.copied for c in merged if c.tokens == (6,)] == [True]
    for n in range(1, len(merged) + 1):  # every prefix of the order is a tree
        chosen = {c.tokens for c in merged[:n]}
        assert all(len(p) == 1 or p[:-1] in chosen for p in chosen)
    for a, b in zip(merged, merged[1:]):
        assert a.value >= b.value


def test_calibration_learns_an_overconfident_drafter():
    cal = Calibration(2, decay=1.0)
    tree = chain_tree(0, [1, 2])
    for _ in range(50):  # q says 0.9 at depth 1, the target never agrees
        cal.observe(tree, [1.0, 0.9, 0.8], [])
    assert cal.scale(1) < 0.05


def test_choose_counts_trades_tokens_for_seconds():
    flat = lambda n, rows: 1.0  # noqa: E731  (a GPU: verifying more costs nothing)
    steep = lambda n, rows: float(n * rows)  # noqa: E731  (every token costs a step)
    values = [[0.9, 0.8, 0.3, 0.1]]
    assert choose_counts(values, flat, 0.1, 4)[0] == [4]
    assert choose_counts(values, steep, 0.1, 4)[0] == [0]
    assert choose_counts(values, lambda n, rows: 1.0 + 0.05 * n * rows, 0.1, 2)[0] == [2]  # the cap
    # rows share one forward padded to the widest tree: a weak row fills a padding slot that costs nothing more,
    # but does not widen the forward
    counts, _ = choose_counts([[0.9], [0.05, 0.04]], lambda n, rows: 1.0 + 0.1 * n * rows, 0.1, 4)
    assert counts == [1, 1]


def test_choose_counts_keeps_the_least_served_row_within_the_limit():
    """A row whose drafts are accepted beside one whose are not: without a limit the good row's tree widens the
    cycle until the other row waits 1.9 plain steps for each of its tokens; with a limit of 1.65 s per token of
    the least-served row, the tree stops where that row's expected wait fits."""
    seconds = lambda n, rows: 1.0 + 0.1 * n  # noqa: E731  (a plain step: seconds(1) = 1.1)
    values = [[0.95] * 8, [0.01] * 8]
    assert choose_counts(values, seconds, 0.0, 8)[0] == [8, 8]
    counts, rate = choose_counts(values, seconds, 0.0, 8, limit=1.65)
    width = max(counts)
    least = 1.0 + 0.01 * counts[1]
    assert seconds(width + 1, 2) <= 1.65 * least < seconds(width + 2, 2)
    assert counts[0] == width and rate > 2 / 1.1
    # nothing within the limit (the draft forward alone costs more): rate 0, so a pause follows
    assert choose_counts([[0.2]], lambda n, rows: 1.0, 1.0, 4, limit=1.5) == ([0], 0.0)


def test_auto_pauses_drafting_when_no_draft_wins():
    costs = FixedTimes(plain=1.0, token=1.5 / 15, draft=1.0, block_size=4)
    planner = TreePlanner("auto", 4, 8, costs, copy_branch=False)
    poor = [[[3, 4]] * 3], [[[0.01, 0.01]] * 3]
    plan = planner.plan([0], *poor)
    assert plan.drafted and plan.trees[0].nodes == 0  # nothing pays for its verify tokens
    assert not planner.drafts_this_cycle()  # and the next cycle skips the draft forward
    good = [[[3, 4]] * 3], [[[0.99, 0.005]] * 3]
    for _ in range(4):  # confident drafts: drafting resumes once the smoothed rates agree
        planner.pause.skip = 0
        plan = planner.plan([0], *good)
    assert plan.trees[0].nodes == 3 and planner.drafts_this_cycle()


def test_a_pause_is_dropped_when_the_target_accepts_the_deepest_drafted_node():
    """Drafts whose confidence undersells them: auto plans a pause from their q, but the target accepts everything
    the small tree offered, so the pause is the prediction's mistake; a tree accepted short of its end keeps it."""
    costs = FixedTimes(plain=1.0, token=0.6 / 15, draft=1.5, block_size=4)
    unsure = [[[3, 4]] * 3], [[[0.5, 0.2]] * 3]
    for accepted_to_the_end, pauses in ((True, False), (False, True)):
        planner = TreePlanner("auto", 4, 8, costs, copy_branch=False)
        planner.pause.backoff = 8  # (a pause as long as the last request's)
        for _ in range(2):
            plan = planner.plan([0], *unsure)
        tree = plan.trees[0]
        deepest = max(tree.depths)
        assert deepest >= 2 and planner.pause.skip > 0  # predicted: a plain step wins
        path = [tree.depths.index(deepest)]
        while tree.parents[path[0]] > 0:
            path.insert(0, tree.parents[path[0]])
        planner.observe(plan, [path if accepted_to_the_end else path[:1]])
        assert (planner.pause.skip > 0) == pauses
