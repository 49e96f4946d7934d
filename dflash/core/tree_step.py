"""The tree cycle of the engine (--verify tree / auto): draft once, build each row's tree (dflash/core/tree.py, sized
by dflash/core/budget.py), verify every row's tree in one forward under positions + ancestor mask, walk it, and have
the engine keep the accepted path's K/V and target features.

A TreeCycle drives its engine through the engine's public cycle API (dflash.core.chain_step.CycleEngine) and owns
what only trees need: each row's prompt lookup for the copied branch, and the last cycle's trees and accepted
paths."""

from __future__ import annotations

import time

from .budget import TreePlanner
from .chain_step import CycleEngine
from .contract import Step
from .sampling import uniform_rows
from .tree import CopyIndex, Tree, TreeInputs


class TreeCycle:
    """The tree cycles of one engine, sized by `planner` (set_verify's)."""

    def __init__(self, planner: TreePlanner):
        self.planner = planner
        self.copies: list[CopyIndex] = []  # per row: prompt lookup for the copied branch (rebuilt when rows join)
        self.last_trees: list[Tree] = []  # the last cycle's trees and accepted paths (introspection: tests, traces)
        self.last_paths: list[list[int]] = []

    def retire(self, keep: list[int], rows: int) -> None:
        """Of the engine's `rows` rows only `keep` stay, in that order."""
        self.copies = [self.copies[i] for i in keep] if len(self.copies) == rows else []
        self.planner.retire(keep)

    def reset(self) -> None:
        """The engine's rows start over."""
        self.copies = []
        self.planner.reset()

    def run(self, engine: CycleEngine, anchors: list[int]) -> list[Step]:
        """One tree cycle for every row of `engine`; row i's anchor is its last committed token."""
        planner, target, b = self.planner, engine.target, engine.block_size
        start = time.perf_counter()
        copies = self._copies(engine, anchors) if planner.copy_branch else []
        drafts = planner.drafts_this_cycle()
        if not drafts and not any(copies):  # a pause with nothing to copy: the plain step, and nothing to plan
            # (a lazy target runs the next step ahead, even before a probe: a probe that plans no node takes it)
            steps = engine.plain_step(anchors, again=not planner.copy_branch)
            planner.observe_plain(len(steps), time.perf_counter() - start)
            self.last_trees, self.last_paths = [], [[] for _ in steps]
            return steps
        draws = engine.row_draws(b)
        # greedy rows of a drafter that drafts some rows: the rows a drafted plan gave no drafted node sit out
        drafting = planner.drafting_rows(len(anchors)) if drafts and draws is None and engine.drafts_some_rows \
            else None
        if drafting == []:
            drafts = False
        if drafts:
            assert engine.drafter is not None  # (the planner drafts only with a drafter)
            some = drafting if drafting is not None and len(drafting) < len(anchors) else None
            draft = engine.draft(anchors, planner.top_k, draws, block=planner.draft_block, rows=some)
            plan = planner.plan(anchors, target.to_host(draft.top_ids), target.to_host(draft.top_probs), copies,
                                drafting)
        else:
            plan = planner.plan(anchors, copies=copies)
        if all(len(t.tokens) == 1 for t in plan.trees):  # no node (drafted or copied) worth its verify cost: plain
            steps = engine.plain_step(anchors, again=planner.pauses_next and not planner.copy_branch)
            for step in steps:
                step.draft_forward = plan.drafted
            planner.observe(plan, [[] for _ in steps], time.perf_counter() - start)
            self.last_trees, self.last_paths = plan.trees, [[] for _ in steps]
            return steps
        inputs = TreeInputs.of(plan.trees)
        ids = target.ids(inputs.ids.tolist())
        logits, features = engine.verify_tree(ids, inputs)
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
        tokens, logprobs = engine.sample(logits, ids, inputs.paths, draws)
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
        self.last_trees, self.last_paths = plan.trees, paths
        # (after a cycle without a draft forward, the features wait behind the earlier pending ones for the next draft)
        engine.commit_slots(slots, inputs.width, [[anchor] + step.drafted for anchor, step in zip(anchors, steps)],
                            features)
        return steps

    def _copies(self, engine: CycleEngine, anchors: list[int]) -> list[list[int]]:
        """Each row's branch copied from its context (prompt lookup), brought up to its anchor."""
        if len(self.copies) != len(engine.rows):
            self.copies = [CopyIndex() for _ in engine.rows]
        out = []
        for index, row, anchor in zip(self.copies, engine.rows, anchors):
            index.update(row + [anchor])
            out.append(index.continuation(engine.block_size - 1))
        return out
