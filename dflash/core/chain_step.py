"""The chain cycle of the engine: draft the block's proposals (or the first `length` of them), verify them in one
forward, commit each row's accepted prefix and the target's own token after it (dflash/core/engine.py has the
arrays of one cycle).

A cycle drives its engine through the engine's public cycle API, CycleEngine: the rows and their models, the
primitives draft / verify / commit, the draws, the sampler."""

from __future__ import annotations

from typing import Protocol, Sequence

from .contract import Draft, Drafter, Step, Target, Verified
from .sampling import RowDraw, RowSampling, accepted_length
from .tree import TreeInputs


class CycleEngine(Protocol):
    """What a cycle needs of its engine (dflash.core.engine.Engine)."""

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


def chain_step(engine: CycleEngine, anchors: Sequence[int], top_k: int = 0, length: int | None = None) -> list[Step]:
    """Draft (with each position's top-k candidates), verify the first `length` proposals (default: all B-1; 0: no
    draft forward, a plain step), commit."""
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
