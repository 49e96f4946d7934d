"""What each cycle runs (--verify chain / tree / auto), chosen per cycle and learnt from each cycle's outcome; the
policy plans, dflash/core/cycle.py runs the plan, and neither reaches into the other.

chain verifies the B-1 proposals every cycle. tree verifies a tree of a fixed node count every cycle. auto chooses,
every cycle, what maximises committed tokens per second at the seconds its own cycles took
(dflash/core/cycle_times.py): trees of some size (dflash/core/budget.py), the chain, or a plain step; rows that
verify by rejection (chains only) get a chain length instead (dflash/core/chain_budget.py). docs/verification.md
says the whole policy."""

from __future__ import annotations

from typing import Sequence

from .budget import AUTO_BUDGET, ITL_LIMIT, VERIFY_MODES, TreePlanner
from .chain_budget import ChainBudget
from .contract import Capabilities, Drafter, Step
from .cycle import CyclePlan, TreeState
from .cycle_times import CycleTimes
from .errors import DFlashError, SettingError
from .row import Row


class Policy:
    """The verify mode of one engine: `mode` as it runs (a refused tree runs as chain, `note` says why), the tree
    planner and its cycles' state (tree, auto), the chain budget (auto, for chains)."""

    def __init__(self, mode: str = "chain", note: str = "", planner: TreePlanner | None = None,
                 chain_budget: ChainBudget | None = None):
        self.mode, self.note = mode, note
        self.planner = planner
        self.trees = TreeState(planner) if planner is not None else None
        self.chain_budget = chain_budget

    @classmethod
    def choose(cls, mode: str, block_size: int, drafter: Drafter | None, capabilities: Capabilities,
               budget: int | None = None, times: CycleTimes | None = None, copy_branch: bool = True,
               itl_limit: float | None = ITL_LIMIT) -> Policy:
        """chain: verify the B-1 proposals. tree: a tree of `budget` nodes every cycle. auto: each cycle, the node
        count that maximises committed tokens per second at the seconds its cycles take (chain when that is best),
        in cycles that take at most `itl_limit` plain steps per token any row expects (None: no limit). `times`:
        what auto's cycles cost (default: learnt from the engine's own cycles, dflash/core/cycle_times.py)."""
        if mode not in VERIFY_MODES:
            raise SettingError("verify", f"got {mode!r}, expected one of {', '.join(VERIFY_MODES)}")
        if budget is not None and budget < 1:
            raise SettingError("tree_budget", f"got {budget}, expected >= 1 draft nodes")
        if mode == "chain" or drafter is None:
            return cls()
        reason, chain_budget = capabilities.tree_refusal, None
        if mode == "auto" and not reason and drafter.distribution:
            # DFlash2: its selector walk picks each proposal given the previous one; trees would branch over the
            # raw top-k without it. auto still chooses how much of the chain to verify, or a plain step (a target
            # that refuses trees keeps its full chain: a static cache wants one verify shape)
            reason = "DFlash2's selector chooses the proposals"
            chain_budget = ChainBudget(block_size, times or CycleTimes(block_size))
        if reason:
            if mode == "tree":
                raise DFlashError(f"--verify tree: {reason}; use --verify chain or auto")
            return cls("chain", f"auto verifies the chain: {reason}", chain_budget=chain_budget)
        if mode == "tree":
            return cls(mode, "", TreePlanner(mode, block_size, budget or block_size - 1, None, copy_branch, itl_limit))
        times = times or CycleTimes(block_size)  # (one machine: the trees' cycles and the chains' learn it together)
        planner = TreePlanner(mode, block_size, budget or max(block_size - 1, AUTO_BUDGET), times, copy_branch,
                              itl_limit)
        return cls(mode, "", planner, ChainBudget(block_size, times))

    def plan(self, batch: Sequence[Row]) -> CyclePlan:
        """This cycle's plan for the engine's rows."""
        rows = [row.sampling for row in batch]
        if self.chain_budget is not None and (self.planner is None or any(not r.greedy for r in rows)):
            # chains only (sampled rows, a DFlash2 drafter, a target without trees): auto chooses their length, or a
            # plain step
            length = self.chain_budget.length(rows=len(rows))
            if not length:
                return CyclePlan("plain", again=self.chain_budget.pauses_next, source="chains")
            return CyclePlan("chain", length, source="chains")
        if self.planner is not None:
            path = self.planner.path([row.pause for row in batch]) if not any(r.chains_only for r in rows) \
                else "chain"
            return CyclePlan(path, source="trees")
        return CyclePlan("chain")

    def observe(self, plan: CyclePlan, steps: list[Step], seconds: float) -> None:
        """The cycle `plan` chose committed `steps` in `seconds`."""
        accepted = [s.accepted for s in steps]
        if plan.source == "chains":
            assert self.chain_budget is not None  # (its plans come from it)
            self.chain_budget.observe(plan.length or 0, accepted, seconds)
        elif plan.source == "trees":
            assert self.planner is not None  # (its plans come from it)
            self.planner.observe_speed(plan.kind, accepted, seconds)

    def reset(self) -> None:
        """The engine's rows start over."""
        if self.trees is not None:
            self.trees.reset()
        if self.chain_budget is not None:
            self.chain_budget.reset()
