"""One cycle of the speculative loop, for every row at once, read top to bottom:

    plan = policy.plan(rows)        a plain step, a chain of L proposals, or trees (dflash/core/policy.py)
    draft                           the drafter's block from the target features pending (engine.draft)
    verify                          one target forward over each row's [anchor, proposals], or its tree
    accept                          each row's longest prefix equal to the target's own tokens; a tree's walk
    commit                          the accepted positions' K/V and target features kept (engine.commit)
    policy.observe(plan, steps, seconds)

A plain step is a chain of no proposals: no draft forward, the anchor alone verified. The engine (engine.py) owns
the arrays and the caches, this module the order of operations, the policy every choice; a new verification mode is
a new kind of plan and a function here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from .budget import TreePlanner
from .contract import Draft, Drafter, Step, Target, Verified
from .rows import Row
from .sampling import RowDraw, RowSampling, accepted_length, uniform_rows
from .tree import TreeInputs


@dataclass(frozen=True)
class CyclePlan:
    """What one cycle runs: "plain" (no draft forward), "chain" (`length` proposals; None: all B-1) or "tree".
    `again`: a plain step whose next cycle is plain too (a lazy target runs it ahead). `source`: which of the
    policy's budgets chose it ("trees", "chains" or "" for a fixed mode), so that it learns from its own cycles."""

    kind: str
    length: int | None = None
    again: bool = False
    source: str = ""


class CycleClock:
    """A cycle's wall time, its own work only. A lazy target's plain step may issue the next cycle's forward before
    it ends (dflash/core/lookahead.py); where issuing it computes most of it (MLX's CPU backend), that work lands in
    this cycle's wall time, and the next cycle's is near nothing. The step ahead moves it to the cycle that takes it
    (`shift`), so the policy learns what each cycle costs, not a pair of a double and a zero."""

    def __init__(self) -> None:
        self.shift = 0.0  # seconds this cycle's wall time misses (+) or holds of another's (-)

    def begin(self) -> float:
        self.shift = 0.0
        return time.perf_counter()

    def since(self, start: float) -> float:
        return time.perf_counter() - start + self.shift


class CyclePolicy(Protocol):
    """What a cycle asks of its policy (dflash.core.policy.Policy): the plan before, the outcome after, and the
    tree planner that sizes its tree cycles."""

    @property
    def planner(self) -> TreePlanner | None: ...
    def plan(self, batch: Sequence[Row]) -> CyclePlan: ...
    def observe(self, plan: CyclePlan, steps: list[Step], seconds: float) -> None: ...


class CycleEngine(Protocol):
    """What a cycle needs of its engine (dflash.core.engine.Engine): its rows and models, the primitives draft /
    verify / commit, the draws and the sampler."""

    clock: CycleClock

    @property
    def batch(self) -> list[Row]: ...
    @property
    def rows(self) -> list[list[int]]: ...
    @property
    def row_sampling(self) -> list[RowSampling]: ...
    @property
    def target(self) -> Target: ...
    @property
    def drafter(self) -> Drafter | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def drafts_some_rows(self) -> bool: ...

    def draft(self, anchors: Sequence[int], top_k: int = 0, draws: list[RowDraw] | None = None,
              block: int | None = None, rows: list[int] | None = None) -> Draft: ...
    def verify(self, draft: Draft, draws: list[RowDraw] | None = None) -> Verified: ...
    def plain_step(self, anchors: Sequence[int], again: bool = False) -> list[Step]: ...
    def verify_tree(self, ids, tree: TreeInputs) -> tuple: ...
    def commit(self, verified: Verified, keeps: Sequence[int]) -> None: ...
    def commit_slots(self, slots: list[list[int]], width: int, committed: list[list[int]], features) -> None: ...
    def row_draws(self, width: int, offset: int = 1, noise: int | None = None) -> list[RowDraw] | None: ...
    def sample(self, logits, block, paths=None, draws=None, draft=None) -> tuple: ...


def run_cycle(engine: CycleEngine, anchors: Sequence[int], policy: CyclePolicy) -> list[Step]:
    """One cycle for every row of `engine`; row i's anchor is its last committed token."""
    start = engine.clock.begin()
    plan = policy.plan(engine.batch)
    if plan.kind == "tree":
        assert policy.planner is not None  # (a policy plans trees only with a tree planner)
        steps = tree_cycle(engine, list(anchors), policy.planner)
    elif plan.kind == "plain":
        steps = engine.plain_step(anchors, again=plan.again)
    else:
        steps = chain_cycle(engine, anchors, length=plan.length)
    policy.observe(plan, steps, engine.clock.since(start))
    return steps


def chain_cycle(engine: CycleEngine, anchors: Sequence[int], top_k: int = 0, length: int | None = None) -> list[Step]:
    """Draft (with each position's top-k candidates), verify the first `length` proposals (default: all B-1; 0: no
    draft forward, a plain step), accept each row's agreeing prefix and the target's token after it, commit."""
    b = engine.block_size
    verified = b if length is None else length + 1
    # a matched row's draft reads the noise of every block position; otherwise only the verified ones are drawn, and
    # a cycle without a draft forward draws what a plain step does: its one token's
    drafts_read_noise = length != 0 and any(r.rule == "match" for r in engine.row_sampling)
    draws = engine.row_draws(b if length != 0 else 1, noise=b if drafts_read_noise else verified)
    if length == 0:  # (the pending features wait for the next draft forward: see Engine.commit)
        draft = Draft(engine.target.ids([[a] for a in anchors]))
    else:  # (a draft of `length` proposals fills just those positions: the drafter's work grows with them)
        draft = engine.draft(anchors, top_k, draws, block=verified)
    result = engine.verify(draft, draws)
    drafted = length != 0 and engine.drafter is not None
    steps = [Step(t[: accepted_length(d, t) + 1], d, len(d), drafted) for d, t in zip(result.proposals, result.tokens)]
    if draws is not None and length != 0:  # what each row's proposal shape accepted (dflash.core.shapes)
        for draw, step in zip(draws, steps):
            draw.sampling.shapes.observe(draw.draft_temperature, step.accepted, step.verified)
    if result.logprobs is not None and result.top_logprobs is not None:
        for step, chosen, top in zip(steps, result.logprobs, result.top_logprobs):
            step.logprobs, step.top_logprobs = chosen[:len(step.tokens)], top[:len(step.tokens)]
    engine.commit(result, [len(s.tokens) for s in steps])
    return steps


def tree_cycle(engine: CycleEngine, anchors: list[int], planner: TreePlanner) -> list[Step]:
    """Draft once, build each row's tree (dflash/core/tree.py, sized by the planner), verify every row's tree in one
    forward under positions + ancestor mask, walk it, commit the accepted path's K/V and target features."""
    target, b = engine.target, engine.block_size
    start = engine.clock.begin()
    batch = engine.batch
    copies = [row.copied(anchor, b - 1) for row, anchor in zip(batch, anchors)] if planner.copy_branch else []
    pauses = [row.pause for row in batch]
    drafts = planner.drafts_this_cycle()
    if not drafts and not any(copies):  # a pause with nothing to copy: the plain step, and nothing to plan
        # (a lazy target runs the next step ahead, even before a probe: a probe that plans no node takes it)
        steps = engine.plain_step(anchors, again=not planner.copy_branch)
        planner.observe_plain(len(steps), engine.clock.since(start))
        return steps
    draws = engine.row_draws(b)
    # greedy rows of a drafter that drafts some rows: the rows a drafted plan gave no drafted node sit out
    drafting = planner.drafting_rows(pauses) if drafts and draws is None and engine.drafts_some_rows else None
    if drafting == []:
        drafts = False
    if drafts:
        assert engine.drafter is not None  # (the planner drafts only with a drafter)
        some = drafting if drafting is not None and len(drafting) < len(anchors) else None
        draft = engine.draft(anchors, planner.top_k, draws, block=planner.draft_block, rows=some)
        plan = planner.plan(anchors, target.to_host(draft.top_ids), target.to_host(draft.top_probs), copies,
                            drafting, pauses)
    else:
        plan = planner.plan(anchors, copies=copies)
    if all(len(t.tokens) == 1 for t in plan.trees):  # no node (drafted or copied) worth its verify cost: plain
        steps = engine.plain_step(anchors, again=planner.pause.going and not planner.copy_branch)
        for step in steps:
            step.draft_forward = plan.drafted
        planner.observe(plan, [[] for _ in steps], engine.clock.since(start))
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
    for tree, row_tokens in zip(plan.trees, tokens):  # accept: each row's walk
        path, bonus = tree.walk(row_tokens)
        accepted = [tree.tokens[i] for i in path]
        paths.append(path)
        slots.append([0] + path)
        steps.append(Step(accepted + [bonus], accepted, tree.nodes, plan.drafted))
    if logprobs is not None:  # committed token k was drawn at slot slots[k]
        for step, row_slots, chosen, top in zip(steps, slots, *logprobs):
            step.logprobs, step.top_logprobs = [chosen[j] for j in row_slots], [top[j] for j in row_slots]
    planner.observe(plan, paths, engine.clock.since(start))
    # (after a cycle without a draft forward, the features wait behind the earlier pending ones for the next draft)
    engine.commit_slots(slots, inputs.width, [[anchor] + step.drafted for anchor, step in zip(anchors, steps)],
                        features)
    return steps
