"""The verify budget: how many draft tokens each cycle verifies, and whether a cycle drafts at all.

`--verify chain` verifies the drafter's B-1 proposals (the DFlash paper's decoding). `--verify tree` verifies a fixed
budget of the most probable prefixes every cycle (the DDTree paper's). `--verify auto` chooses, every cycle and for
every row, the node count that maximises expected committed tokens per second on this device: expected tokens from
the calibrated acceptance estimates of dflash.tree, seconds from the costs measured at load (dflash/costs.py). A
short chain, a wide tree or the root alone (an autoregressive step) are all answers it can give. When even the best
drafted cycle is predicted to lose to a cycle without a draft forward, it stops drafting for a while (1, 2, 4 .. 16
cycles, then a drafted cycle probes again), so a drafter that is almost always wrong costs little more than not
drafting; the copied branch still runs in those cycles, since it costs no draft forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .tree import Calibration, Tree, best_first, choose_counts, merge_candidates, to_tree

VERIFY_MODES = ("chain", "tree", "auto")
STRETCH, RETRY_AFTER = 2, 128  # auto: cycles per stretch of one path; cycles before the slower path is re-tried
MAX_TOP_K = 16  # draft candidates per depth the tree may branch over
PLAIN_EVERY = 32  # ChainBudget: drafted cycles in a row before a plain step is timed again


@dataclass
class Costs:
    """Seconds on this device: one draft forward (one row), and one target forward of n tokens after a short
    context, measured at a few n and interpolated linearly (extrapolated from the last two beyond them)."""

    draft: float
    verify: list[tuple[int, float]]  # (tokens, seconds), increasing tokens

    def verify_seconds(self, tokens: int) -> float:
        pts = self.verify
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2:] if len(pts) > 1 else (pts[0], (pts[0][0] + 1, pts[0][1]))
        return t1 + max(t1 - t0, 0.0) * (tokens - n1) / (n1 - n0)

    def to_json(self) -> dict:
        return {"draft_seconds": self.draft, "verify_seconds": [list(p) for p in self.verify]}

    @classmethod
    def from_json(cls, d: dict) -> "Costs":
        return cls(float(d["draft_seconds"]), [(int(n), float(t)) for n, t in d["verify_seconds"]])


@dataclass
class Plan:
    trees: list[Tree]
    qs: list[list[float]]  # per row and node: the surrogate probability (0 for copied-only nodes)
    drafted: bool


class TreePlanner:
    """Builds each cycle's trees (one per row) and learns from what the target accepted."""

    def __init__(self, mode: str, block_size: int, budget: int, costs: Costs | None = None,
                 copy_branch: bool = True):
        self.mode, self.block_size, self.budget, self.costs = mode, block_size, budget, costs
        self.copy_branch = copy_branch
        self.top_k = min(MAX_TOP_K, budget)
        self.calibration = Calibration(block_size - 1)
        self.skip, self.backoff = 0, 0  # auto: cycles left without a draft forward; the next pause's length
        self.rates: list[float] | None = None  # auto: smoothed predicted tokens/s with and without the draft
        # auto: measured tokens/s of the chain's own path (no host read between draft and verify, so on a lazy
        # backend the draft overlaps the verify's graph building) against tree cycles; the loser is re-tried now
        # and then, a few cycles at a time
        self.measured: dict[str, float | None] = {"chain": None, "tree": None}
        self.since = {"chain": 0, "tree": 0}
        self.run: tuple[str, int] = ("tree", 0)  # the current stretch: which path, cycles left
        # seconds a cycle takes beyond its forwards (host work: the heap, the walk, sampling), learnt online
        self.overhead = {True: 0.0, False: 0.0}

    def path(self) -> str:
        """auto: "chain" or "tree" for this cycle (tree: always)."""
        if self.mode != "auto":
            return "tree"
        kind, left = self.run
        if left <= 0:
            chain, tree = self.measured["chain"], self.measured["tree"]
            if tree is None or chain is None:
                kind = "tree" if tree is None or self.since["chain"] < 8 else "chain"
            else:
                kind = "chain" if chain > tree else "tree"
                loser = "tree" if kind == "chain" else "chain"
                if self.since[loser] >= RETRY_AFTER:
                    kind = loser
            left = STRETCH
        self.run = (kind, left - 1)
        return kind

    def observe_speed(self, kind: str, tokens: int, seconds: float) -> None:
        """One cycle's committed tokens (per row) in `seconds` on the chain's path or a tree's."""
        rate = tokens / max(seconds, 1e-9)
        old = self.measured[kind]
        self.measured[kind] = rate if old is None else old + 0.2 * (rate - old)
        for k in self.since:
            self.since[k] = 0 if k == kind else self.since[k] + 1

    def drafts_this_cycle(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def plan(self, anchors: Sequence[int], top_ids=None, top_probs=None,
             copies: Sequence[Sequence[int]] = ()) -> Plan:
        """Trees for this cycle. top_ids / top_probs (rows, B-1, k) host lists when the cycle drafted, else None."""
        rows = len(anchors)
        copies = list(copies) if self.copy_branch and copies else [[] for _ in range(rows)]
        drafted = top_ids is not None
        candidates = []
        for r in range(rows):
            draft = best_first(top_ids[r], top_probs[r], self.budget, self.block_size - 1) if drafted else []
            candidates.append(merge_candidates(draft, copies[r][: self.block_size - 1], self.calibration))
        if self.mode == "tree":
            counts = [min(self.budget, len(c)) for c in candidates]
        else:
            counts, rate = self._counts(candidates, drafted)
            if drafted:
                self._update_pause(copies, rate)
        trees = [to_tree(a, c[:n]) for a, c, n in zip(anchors, candidates, counts)]
        qs = [[1.0] + [x.q for x in c[:n]] for c, n in zip(candidates, counts)]
        return Plan(trees, qs, drafted)

    def observe(self, plan: Plan, paths: Sequence[Sequence[int]], seconds: float | None = None) -> None:
        """Learn from one verified cycle: which nodes the target accepted, and (auto) how long the cycle took."""
        for tree, qs, path in zip(plan.trees, plan.qs, paths):
            self.calibration.observe(tree, qs, list(path))
        if seconds is not None and self.costs is not None:
            rows, width = len(plan.trees), max(len(t.tokens) for t in plan.trees)
            forwards = self.costs.verify_seconds(rows * width) + (self.costs.draft * rows if plan.drafted else 0.0)
            extra = max(seconds - forwards, 0.0)
            self.overhead[plan.drafted] += 0.1 * (extra - self.overhead[plan.drafted])

    # ---- auto ------------------------------------------------------------------------------------------------------
    def _counts(self, candidates, drafted: bool) -> tuple[list[int], float]:
        values = [[c.value for c in cs] for cs in candidates]
        fixed = (self.costs.draft * len(candidates) if drafted else 0.0) + self.overhead[drafted]
        return choose_counts(values, self.costs.verify_seconds, fixed, self.budget)

    def _update_pause(self, copies, drafted_rate: float) -> None:
        """Compare the predicted rate of drafted cycles with what the same cycles would give without the draft
        forward (the copied branch alone), both smoothed over recent cycles so that one unsure draft does not stop
        a good drafter: pause drafting, for longer each time, while not drafting wins."""
        undrafted = [merge_candidates([], c[: self.block_size - 1], self.calibration) for c in copies]
        _, undrafted_rate = self._counts(undrafted, drafted=False)
        if self.rates is None:
            self.rates = [drafted_rate, undrafted_rate]
        else:
            self.rates = [r + 0.3 * (x - r) for r, x in zip(self.rates, (drafted_rate, undrafted_rate))]
        if self.rates[1] > self.rates[0]:
            self.backoff = min(max(1, 2 * self.backoff), 16)
            self.skip = self.backoff
        else:
            self.backoff = 0


class ChainBudget:
    """auto for rows that verify by rejection (chains only): how many of the B-1 sampled proposals a cycle verifies,
    and whether it drafts at all. Expected tokens of a chain of L proposals are 1 + sum_j prod_{i<=j} a_i with a_i
    the measured rate at which position i accepts when reached (an exponential average over recent cycles, under the
    rule in use); seconds are T_draft + T_verify(L + 1) from the device profile plus a correction learnt online from
    the cycles' own wall time (either sign: a profile measured while the machine was busy overstates). L = 0
    is a plain target step without the draft forward; while it wins, drafting pauses for 1, 2, 4 .. 16 cycles
    between probes, as the tree planner's pauses do."""

    def __init__(self, block_size: int, costs: Costs, prior: float = 0.5, smoothing: float = 0.1):
        self.costs, self.smoothing = costs, smoothing
        self.rates = [prior] * (block_size - 1)
        self.overhead = {True: 0.0, False: 0.0}
        self.skip, self.backoff, self.probing = 0, 0, False
        self.since_plain = 0  # drafted cycles since the last plain one

    def expected(self, length: int) -> float:
        tokens, reach = 1.0, 1.0
        for a in self.rates[:length]:
            reach *= a
            tokens += reach
        return tokens

    def seconds(self, length: int) -> float:
        drafted = length > 0
        forwards = self.costs.verify_seconds(length + 1) + (self.costs.draft if drafted else 0.0)
        return max(forwards + self.overhead[drafted], 0.1 * forwards)

    def length(self, can_pause: bool) -> int:
        """Proposals to verify this cycle (0: no draft forward; only when `can_pause`). The cycle after a pause
        drafts (a probe), so the acceptance estimates stay current."""
        best = max(range(1, len(self.rates) + 1), key=lambda n: self.expected(n) / self.seconds(n))
        if not can_pause:
            return best
        if self.skip > 0 or self.since_plain >= PLAIN_EVERY:  # (a plain step now and then keeps its time known)
            self.skip = max(self.skip - 1, 0)
            return 0
        plain_wins = self.expected(0) / self.seconds(0) > self.expected(best) / self.seconds(best)
        if plain_wins and not self.probing:
            self.backoff = min(max(1, 2 * self.backoff), 16)
            self.skip, self.probing = self.backoff - 1, True
            return 0
        self.probing = False
        if not plain_wins:
            self.backoff = 0
        return best

    def observe(self, length: int, accepted: Sequence[int], seconds: float) -> None:
        """One cycle: `length` proposals verified per row, rows accepted `accepted[r]` of them, in `seconds`."""
        s = self.smoothing
        for k in accepted:
            for i in range(min(k + 1, length)):  # position i was reached; accepted unless i == k
                self.rates[i] += s * ((1.0 if i < k else 0.0) - self.rates[i])
        drafted = length > 0
        self.since_plain = self.since_plain + 1 if drafted else 0
        rows = max(len(accepted), 1)
        forwards = self.costs.verify_seconds(rows * (length + 1)) + (self.costs.draft * rows if drafted else 0.0)
        self.overhead[drafted] += s * (seconds - forwards - self.overhead[drafted])
