"""The tree cycle of the engine (--verify tree / auto): draft once, build each row's tree (dflash/core/tree.py, sized
by dflash/core/budget.py), verify every row's tree in one forward under positions + ancestor mask, walk it, and keep
the accepted path's K/V and target features."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .contract import Pending, Step
from .sampling import uniform_rows
from .tree import CopyIndex, TreeInputs

if TYPE_CHECKING:
    from .engine import Engine


def tree_step(engine: Engine, anchors: list[int]) -> list[Step]:
    """One tree cycle for every row of `engine`; row i's anchor is its last committed token."""
    planner, target, b = engine.planner, engine.target, engine.block_size
    assert planner is not None  # (tree cycles run under set_verify's planner)
    start = time.perf_counter()
    copies = _copies(engine, anchors) if planner.copy_branch else []
    drafts = planner.drafts_this_cycle()
    if not drafts and not any(copies):  # a pause with nothing to copy: the plain step, and nothing to plan
        steps = engine._chain_step(anchors, top_k=0, length=0)
        planner.observe_plain(len(steps), time.perf_counter() - start)
        engine.last_trees, engine.last_paths = [], [[] for _ in steps]
        return steps
    draws = engine._row_draws(b)
    if drafts:
        assert engine.drafter is not None  # (the planner drafts only with a drafter)
        draft = engine.drafter.propose(target.ids([[a] for a in anchors]), engine._take_pending(),
                                       planner.draft_block, planner.top_k, draws)
        plan = planner.plan(anchors, target.to_host(draft.top_ids), target.to_host(draft.top_probs), copies)
    else:
        plan = planner.plan(anchors, copies=copies)
    if all(len(t.tokens) == 1 for t in plan.trees):  # no node (drafted or copied) worth its verify cost: a plain step
        steps = engine._chain_step(anchors, top_k=0, length=0)
        for step in steps:
            step.draft_forward = plan.drafted
        planner.observe(plan, [[] for _ in steps], time.perf_counter() - start)
        engine.last_trees, engine.last_paths = plan.trees, [[] for _ in steps]
        return steps
    inputs = TreeInputs.of(plan.trees)
    ids = target.ids(inputs.ids.tolist())
    logits, features = target.forward(ids, last_only=False, tree=inputs)
    if draws is not None:  # the node at depth d draws the token at the anchor's position + 1 + d
        for draw, tree, depths in zip(draws, plan.trees, inputs.depths.tolist()):
            if draw.gumbel is not None:
                draw.gumbel = draw.gumbel[target.ids([depths])[0]]
            if draw.rule == "multi":  # its nodes' children, tried in order, each with a uniform of its own
                draw.children, draw.counted = tree.children(inputs.width)
                draw.child_u = [row for d in depths for row in uniform_rows(
                    draw.sampling.seed, "children", [draw.position + d], len(draw.children[0]))]
                assert draw.residual_u is not None  # (a sampled row's draws)
                draw.residual_u = [draw.residual_u[d] for d in depths]
    tokens, logprobs = engine._sample(logits, engine.rows, ids, inputs.paths, draws)
    tokens = target.to_host(tokens)
    steps, paths, slots = [], [], []
    for tree, row_tokens in zip(plan.trees, tokens):
        path, bonus = tree.walk(row_tokens)
        accepted = [tree.tokens[i] for i in path]
        paths.append(path)
        slots.append([0] + path)
        steps.append(Step(accepted + [bonus], accepted, tree.nodes, plan.drafted))
    if logprobs is not None:  # committed token k was drawn at slot slots[k]
        for step, row_slots, chosen, top in zip(steps, slots, *logprobs):
            step.logprobs, step.top_logprobs = [chosen[j] for j in row_slots], [top[j] for j in row_slots]
    planner.observe(plan, paths, time.perf_counter() - start)
    engine.last_trees, engine.last_paths = plan.trees, paths  # (introspection: tests, traces)
    target.keep_slots(slots, inputs.width)
    for row, anchor, step in zip(engine.rows, anchors, steps):
        row.extend([anchor] + step.drafted)
    if features is None:
        return steps  # (a drafter that reads no target features)
    # (after a cycle without a draft forward, the features wait behind the earlier pending ones for the next draft)
    engine._queue_pending(Pending(target.gather(features, slots), [len(s) for s in slots]))
    return steps


def _copies(engine: Engine, anchors: list[int]) -> list[list[int]]:
    """Each row's branch copied from its context (prompt lookup), brought up to its anchor."""
    if len(engine._copies) != len(engine.rows):
        engine._copies = [CopyIndex() for _ in engine.rows]
    copies = []
    for index, row, anchor in zip(engine._copies, engine.rows, anchors):
        index.update(row + [anchor])
        copies.append(index.continuation(engine.block_size - 1))
    return copies
