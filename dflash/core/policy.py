"""What each cycle runs (--verify chain / tree / auto): the policy plans, dflash/core/cycle.py runs the plan. auto
plans trees, the chain or a plain step (dflash/core/budget.py), or for rows that verify by rejection a chain's length
(ChainBudget). docs/verification.md says the policy."""

from __future__ import annotations

from typing import Sequence

from .budget import AUTO_BUDGET, ITL_LIMIT, VERIFY_MODES, Pause, TreePlanner
from .contract import Capabilities, Drafter, Step
from .cycle import CyclePlan
from .cycle_times import CycleTimes
from .errors import DFlashError, SettingError
from .rows import Row


PLAIN_EVERY = 32  # drafted cycles in a row before a plain step is timed again


class ChainBudget:
    """auto for rows that verify by rejection: how many of the B-1 sampled proposals a cycle verifies (0: a plain
    step). A chain of L commits 1 + sum_j prod_{i<=j} a_i, a_i the smoothed rate at which position i accepts when
    reached (one never reached: the one before it's, so chains grow where the first positions accept)."""

    def __init__(self, block_size: int, times: CycleTimes, prior: float = 0.5, smoothing: float = 0.1):
        self.times, self.smoothing = times, smoothing
        self.rates = [prior] * (block_size - 1)
        self.reached = 0  # positions some cycle has verified (the rates past them are the prior's)
        self.pause = Pause()
        self.since_plain = 0  # drafted cycles since the last plain one

    def expected(self, length: int) -> float:
        tokens, reach, last = 1.0, 1.0, self.rates[0]
        for i, a in enumerate(self.rates[:length]):
            last = a if i < max(self.reached, 1) else last
            reach *= last
            tokens += reach
        return tokens

    def rate(self, length: int, rows: int = 1) -> float:
        """Tokens per second per row of a cycle verifying `length` proposals per row (0: no draft forward)."""
        return self.expected(length) / self.times.cycle_seconds(length + 1, rows, length > 0, length + 1)

    def length(self, rows: int = 1) -> int:
        """Proposals every one of `rows` rows verifies this cycle: 0 in a pause (or to time a plain step again)."""
        if self.pause.waits() or self.since_plain >= PLAIN_EVERY:
            return 0
        return self.best(rows)

    def best(self, rows: int = 1) -> int:
        """The chain length of the most tokens per second."""
        return max(range(1, len(self.rates) + 1), key=lambda n: self.rate(n, rows))

    def reset(self) -> None:
        """A new request: its first cycle drafts (the pause's length is kept: a probe that loses pauses as long)."""
        self.pause.skip = 0

    def observe(self, length: int, accepted: Sequence[int], seconds: float) -> None:
        """One cycle: `length` proposals per row, row r accepted `accepted[r]`, in `seconds`. After a drafted one,
        the next cycles pause while a plain step's rate beats the best chain's."""
        s, rows, drafted = self.smoothing, max(len(accepted), 1), length > 0
        self.reached = max(self.reached, length)
        for k in accepted:
            for i in range(min(k + 1, length)):  # position i was reached; accepted unless i == k
                self.rates[i] += s * ((1.0 if i < k else 0.0) - self.rates[i])
        self.since_plain = self.since_plain + 1 if drafted else 0
        self.times.observe(length + 1, rows, drafted, seconds, length + 1)
        if drafted:
            plain = self.rate(0, rows)
            wins = self.rate(self.best(rows), rows) >= plain
            if not wins and self.pause.backoff and sum(accepted) and (1 + sum(accepted) / rows) / seconds > plain:
                # a probe that committed more than a plain step would have halves the next pause (a quarter here,
                # doubled as it starts), so rates a bad stretch pulled down are measured again within a few dozen
                # cycles (docs/sampling.md has the measurements)
                self.pause.backoff //= 4
            self.pause.observe(wins)


class Policy:
    """The verify mode of one engine: `mode` as it runs (a refused tree runs as chain, `note` says why), the tree
    planner (tree, auto) and the chain budget (auto, for rows on chains)."""

    def __init__(self, mode: str = "chain", note: str = "", planner: TreePlanner | None = None,
                 chain_budget: ChainBudget | None = None):
        self.mode, self.note = mode, note
        self.planner = planner
        self.chain_budget = chain_budget

    @classmethod
    def choose(cls, mode: str, block_size: int, drafter: Drafter | None, capabilities: Capabilities,
               budget: int | None = None, times: CycleTimes | None = None, copy_branch: bool = True,
               itl_limit: float | None = ITL_LIMIT) -> Policy:
        """chain: verify the B-1 proposals. tree: a tree of `budget` nodes every cycle. auto: the plan of the most
        tokens per second, in cycles of at most `itl_limit` plain steps per token any row expects (None: no limit).
        `times`: what cycles cost (default: learnt from the engine's own, dflash/core/cycle_times.py)."""
        if mode not in VERIFY_MODES:
            raise SettingError("verify", f"got {mode!r}, expected one of {', '.join(VERIFY_MODES)}")
        if budget is not None and budget < 1:
            raise SettingError("tree_budget", f"got {budget}, expected >= 1 draft nodes")
        if mode == "chain" or drafter is None:
            return cls()
        reason = capabilities.tree_refusal
        if mode == "tree":
            if reason:
                raise DFlashError(f"--verify tree: {reason}; use --verify chain or auto")
            return cls(mode, "", TreePlanner(mode, block_size, budget or block_size - 1, None, copy_branch, itl_limit))
        if reason:  # (a target that refuses trees keeps its whole chain: a static cache wants one verify shape)
            return cls("chain", f"auto verifies the chain: {reason}")
        times = times or CycleTimes(block_size)  # (one machine: the trees' cycles and the chains' learn it together)
        if drafter.distribution:  # DFlash2: its selector picks each proposal given the previous one, where a tree
            # would branch over the raw top-k; auto chooses the chain's length
            return cls("chain", "auto verifies the chain: DFlash2's selector chooses the proposals",
                       chain_budget=ChainBudget(block_size, times))
        planner = TreePlanner(mode, block_size, budget or max(block_size - 1, AUTO_BUDGET), times, copy_branch,
                              itl_limit)
        return cls(mode, "", planner, ChainBudget(block_size, times))

    def plan(self, batch: Sequence[Row]) -> CyclePlan:
        """This cycle's plan for the engine's rows."""
        rows = [row.sampling for row in batch]
        if self.chain_budget is not None and (self.planner is None or any(not r.greedy for r in rows)):
            # chains only (sampled rows, a DFlash2 drafter, a target without trees): auto chooses their length
            length = self.chain_budget.length(rows=len(rows))
            if not length:
                return CyclePlan("plain", again=self.chain_budget.pause.going, source="chains")
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
        elif plan.source == "trees" and plan.kind == "chain":  # (a tree cycle's planner learnt it in its cycle)
            assert self.planner is not None  # (its plans come from it)
            self.planner.observe_chain(len(steps), seconds)

    def reset(self) -> None:
        """The engine's rows start over."""
        if self.planner is not None:
            self.planner.reset()
        if self.chain_budget is not None:
            self.chain_budget.reset()
