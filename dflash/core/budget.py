"""The verify budget: how many draft tokens each cycle verifies, and whether a cycle drafts at all.

`--verify chain` verifies the drafter's B-1 proposals (the DFlash paper's decoding). `--verify tree` verifies a fixed
budget of the most probable prefixes every cycle (the DDTree paper's). `--verify auto` chooses, every cycle and for
every row, the node count that maximises expected committed tokens per second on this device: expected tokens from the
calibrated acceptance estimates of dflash.core.tree, seconds from the costs measured at load (dflash/core/costs.py). A
short chain, a wide tree or the root alone (an autoregressive step) are all answers it can give. When even the best
drafted cycle is predicted to lose to a cycle without a draft forward, it stops drafting for a while (1, 2, 4 .. 64
cycles, then a drafted cycle probes again), so a drafter that is almost always wrong costs little more than not
drafting; the copied branch still runs in those cycles, since it costs no draft forward. For a batch the rule is the
same over all rows at once: costs of r rows of n tokens each after the batch's context (measured at load at two context
lengths), one global budget across rows (a row whose drafts are rarely accepted gets no nodes), and a pause skips the
whole batch's draft forward; a cycle with neither a draft nor a copied node is a plain step. The draft forward itself
fills 2, 4, 8 or all B positions: the drafter's work grows with them, and where deep nodes do not pay (a CPU at high
load) the block whose best plan is fastest, its own draft forward counted, is drafted. Every prediction goes through a
CycleClock fitted online on the cycles' own wall times. Whether a cycle runs on the chain's own path or a
tree's is dflash/core/path_choice.py's estimate. Every row of a batch waits for the whole cycle, so a plan is taken only
while the cycle lasts at most ITL_LIMIT plain steps per token that its least-served row expects (docs/trees.md, "Latency
limit").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .corrections import Corrections
from .path_choice import PathChoice
from .tree import Calibration, Tree, best_first, choose_counts, merge_candidates, to_tree

VERIFY_MODES = ("chain", "tree", "auto")
MAX_TOP_K = 16  # draft candidates per depth the tree may branch over
PLAIN_EVERY = 32  # ChainBudget: drafted cycles in a row before a plain step is timed again
MAX_PAUSE = 64  # the longest run of cycles without a draft forward between probes (a probe costs ~2 steps)
BLOCK_SMOOTHING = 0.2  # auto: weight of a cycle's predicted rate in each draft block's smoothed one
BLOCK_MARGIN = 0.1  # auto: how much faster a shorter draft block must be predicted to be to replace the drafted one
ITL_LIMIT = 1.5  # auto: a cycle takes at most this many plain steps per token its least-served row expects
MEMO_SIZE = 4096  # Costs: answers kept


def interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Linear between measured (x, seconds) points, flat below the first, extrapolated from the last two beyond the
    last (never decreasing)."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, t0), (x1, t1) in zip(points, points[1:]):
        if x <= x1:
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
    (x0, t0), (x1, t1) = points[-2:] if len(points) > 1 else (points[0], (points[0][0] + 1, points[0][1]))
    return t1 + max(t1 - t0, 0.0) * (x - x1) / (x1 - x0)


@dataclass
class Costs:
    """Seconds on this device: one draft forward and one target forward of n tokens after `context` cached positions,
    for one row (`draft`, `verify`) and, where the backend batches, for r rows of n tokens each (`batch`: r -> points,
    `draft_batch`: r -> seconds), measured at a few r and n. Without batch points, r rows of n tokens cost what one
    row of r * n tokens does and r drafts cost r single ones (a CPU pays for every token; a GPU below its compute
    knee does not, which only the batch points show). `longer` is the same profile after a longer context: every
    token attends to every cached position, so at a serving load's contexts a forward can cost twice what it costs
    after a short one; a cost at `context` positions is interpolated between the two (linear past the longer)."""

    draft: float
    verify: list[tuple[int, float]]  # (tokens, seconds), increasing tokens
    batch: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # rows -> (tokens per row, seconds)
    draft_batch: dict[int, float] = field(default_factory=dict)  # rows -> seconds of one draft forward
    context: int = 64  # positions cached before the measured forwards
    longer: Costs | None = None  # the same forwards after more cached positions
    # draft forwards of fewer positions than the block: block -> rows -> seconds (the largest block: the full one).
    # The drafter's work grows with the positions it fills; without points a shorter draft costs a full one
    draft_blocks: dict[int, dict[int, float]] = field(default_factory=dict)

    # per cycle shape, the wall clock over the profile, learnt from the cycles the engine ran (persisted with it)
    corrections: Corrections = field(default_factory=Corrections, repr=False, compare=False)
    # answers already given: a cycle's plan asks the same few dozen questions (one batch, one context) many times
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def verify_seconds(self, tokens: int, rows: int = 1, context: float | None = None) -> float:
        return self._remember(("verify", tokens, rows, context),
                              lambda: self._at(context, lambda c: c._verify(tokens, rows)))

    def draft_seconds(self, rows: int = 1, context: float | None = None, block: int | None = None) -> float:
        """One draft forward of `block` positions (default: the whole block) for `rows` rows."""
        return self._remember(("draft", rows, context, block),
                              lambda: self._at(context, lambda c: c._draft(rows)) * self._block_share(block, rows))

    def _remember(self, key: tuple, seconds) -> float:
        answer = self._memo.get(key)
        if answer is None:
            if len(self._memo) >= MEMO_SIZE:  # (contexts grow: old ones are not asked again)
                self._memo.clear()
            answer = self._memo[key] = seconds()
        return answer

    def cycle_seconds(self, tokens: int, rows: int = 1, drafted: bool = True, context: float | None = None,
                      block: int | None = None) -> float:
        """A cycle's forwards: the draft forward (of `block` positions) when `drafted`, then a target forward of
        `tokens` per row."""
        return self.corrections.factor(tokens, rows, drafted) * self.measured_cycle(tokens, rows, drafted, context,
                                                                                   block)

    def measured_cycle(self, tokens: int, rows: int = 1, drafted: bool = True, context: float | None = None,
                       block: int | None = None) -> float:
        """cycle_seconds as the profile measured it, before the online corrections."""
        draft = self.draft_seconds(rows, context, block) if drafted else 0.0
        return self.verify_seconds(tokens, rows, context) + draft

    def observe(self, tokens: int, rows: int, drafted: bool, seconds: float, context: float | None = None,
                block: int | None = None) -> None:
        """A cycle of this shape took `seconds` on the wall clock: its shape's correction learns from it."""
        self.corrections.observe(tokens, rows, drafted, self.measured_cycle(tokens, rows, drafted, context, block),
                                 seconds)

    def _block_share(self, block: int | None, rows: int) -> float:
        """A draft of `block` positions over one of the whole block, at `rows` rows (measured at a few blocks)."""
        if block is None or not self.draft_blocks or block >= max(self.draft_blocks):
            return 1.0
        at = {b: interpolate(sorted(points.items()), rows) for b, points in self.draft_blocks.items()}
        full = at[max(at)]
        return interpolate([(b, at[b] / full) for b in sorted(at)], block)

    def _at(self, context: float | None, seconds) -> float:
        near = seconds(self)
        if context is None or self.longer is None or context <= self.context:
            return near
        growth = max(seconds(self.longer) - near, 0.0) / (self.longer.context - self.context)
        return near + growth * (context - self.context)

    def _verify(self, tokens: int, rows: int) -> float:
        if rows == 1 or not self.batch:
            return interpolate(self.verify, rows * tokens)
        widest = min(points[-1][0] for points in self.batch.values())
        curves = [(1, self.verify), *sorted(self.batch.items())]
        seconds = interpolate([(r, interpolate(points, min(tokens, widest))) for r, points in curves], rows)
        if tokens > widest:  # past the batch points: extra tokens cost what they add to one row's longer forward
            seconds += interpolate(self.verify, rows * tokens) - interpolate(self.verify, rows * widest)
        return seconds

    def _draft(self, rows: int) -> float:
        if rows == 1 or not self.draft_batch:
            return self.draft * rows
        return interpolate([(1, self.draft), *sorted(self.draft_batch.items())], rows)

    def to_json(self) -> dict:
        return {"draft_seconds": self.draft, "verify_seconds": [list(p) for p in self.verify],
                "batch_verify_seconds": {str(r): [list(p) for p in pts] for r, pts in self.batch.items()},
                "batch_draft_seconds": {str(r): t for r, t in self.draft_batch.items()}, "context": self.context,
                "draft_block_seconds": {str(b): {str(r): t for r, t in pts.items()}
                                        for b, pts in self.draft_blocks.items()},
                **({"longer": self.longer.to_json()} if self.longer is not None else {})}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        points = lambda pts: [(int(n), float(t)) for n, t in pts]  # noqa: E731
        return cls(float(d["draft_seconds"]), points(d["verify_seconds"]),
                   {int(r): points(pts) for r, pts in d.get("batch_verify_seconds", {}).items()},
                   {int(r): float(t) for r, t in d.get("batch_draft_seconds", {}).items()}, int(d.get("context", 64)),
                   cls.from_json(d["longer"]) if "longer" in d else None,
                   {int(b): {int(r): float(t) for r, t in pts.items()}
                    for b, pts in d.get("draft_block_seconds", {}).items()})


def _chain_tokens(top_probs: Sequence[Sequence[float]], calibration: Calibration) -> float:
    """Tokens a chain cycle is expected to commit: 1 + the calibrated values of the drafter's rank-1 nodes at every
    depth (valued as merge_candidates values them: q times the depth's scale, capped by the parent's value)."""
    total, q, value = 1.0, 1.0, math.inf
    for depth, probs in enumerate(top_probs, start=1):
        q *= probs[0]
        value = min(value, q * calibration.scale(depth))
        total += value
    return total


class CycleClock:
    """What a cycle really takes, from what the profile says its forwards take: k * forwards + a, fitted online over
    recent cycles by exponentially weighted least squares. k carries what the profile under-counts in proportion to
    the work (more rows than its batches, a second thread of the process such as a server's event loop), a the host
    work per cycle (the heap, the walk, sampling). While the cycles' forwards barely vary (one shape), a ridge towards
    the prior k leaves the difference to a, as a plain mean of the excess; once shapes vary, the slope is measured."""

    def __init__(self, smoothing: float = 0.1, ridge: float = 0.01, k: float = 1.0, a: float = 0.0):
        self.smoothing, self.ridge, self.prior = smoothing, ridge, k
        self.sums = [0.0] * 5  # decayed means of 1, x, x^2, y, x*y (x: the profile's seconds, y: the measured)
        self.k, self.a = k, a

    def __call__(self, forwards: float) -> float:
        return max(self.k * forwards + self.a, 0.1 * forwards)

    def observe(self, forwards: float, seconds: float) -> None:
        x, y, s = forwards, seconds, self.smoothing
        self.sums = [m + s * (v - m) for m, v in zip(self.sums, (1.0, x, x * x, y, x * y))]
        w, sx, sxx, sy, sxy = self.sums
        # minimise sum w (y - kx - a)^2 + r sxx (k - prior)^2:
        # [[sxx (1 + r), sx], [sx, w]] [k, a] = [sxy + r sxx prior, sy]
        a11, b1 = sxx * (1 + self.ridge), sxy + self.ridge * sxx * self.prior
        det = a11 * w - sx * sx
        if det <= 0:
            return
        self.k = max((w * b1 - sx * sy) / det, 0.0)
        self.a = (a11 * sy - sx * b1) / det


@dataclass
class Plan:
    trees: list[Tree]
    qs: list[list[float]]  # per row and node: the surrogate probability (0 for copied-only nodes)
    drafted: bool
    block: int  # positions of the cycle's draft forward


class TreePlanner:
    """Builds each cycle's trees (one per row) and learns from what the target accepted."""

    def __init__(self, mode: str, block_size: int, budget: int, costs: Costs | None = None,
                 copy_branch: bool = True, itl_limit: float | None = ITL_LIMIT):
        self.mode, self.block_size, self.budget, self.costs = mode, block_size, budget, costs
        self.copy_branch, self.itl_limit = copy_branch, itl_limit
        self.chain_within = True  # auto: whether the last drafted cycle's rows could wait for a whole chain
        self.top_k = min(MAX_TOP_K, budget)
        # auto: draft candidates enumerated per row, twice the most any row verified last cycle (a tree of 17 nodes
        # no longer enumerates, calibrates and sorts 256 candidates per cycle; a plan that uses them all doubles it)
        self.reach = min(budget, 2 * (block_size - 1))
        self.calibration = Calibration(block_size - 1)
        self.idle_trees = 0  # root-only trees of plain cycles not yet forgotten by (Calibration.age) the calibration
        self.skip, self.backoff = 0, 0  # auto: cycles left without a draft forward; the next pause's length
        self.rates: list[float] | None = None  # auto: smoothed predicted tokens/s with and without the draft
        self.choice = PathChoice()  # auto: the chain's path or a tree's, cycle by cycle
        self.last_drafted = True
        self.clock = {True: CycleClock(), False: CycleClock()}  # drafted or not: the profile -> the wall clock
        self.context: float | None = None  # cached positions of the batch's longest row this cycle (the engine's)
        # auto: positions of the next draft forward (the measured shorter blocks, or the whole block)
        self.blocks = sorted({b for b in (costs.draft_blocks if costs else ()) if b < block_size} | {block_size})
        self.draft_block = self.drafted_block = block_size
        self.block_rates: dict[int, float] = {}  # auto: smoothed predicted tokens/s of each block's best plan
        # drafted cycles before a block is tried again from the one below, and that wait's next length
        self.deepen_wait, self.deepen_after = {b: 0 for b in self.blocks}, {b: 1 for b in self.blocks}

    def path(self) -> str:
        """auto: "chain" or "tree" for this cycle (tree: always). While cycles without a draft forward win (a pause,
        and its probes), and while a shorter draft block wins, the tree path runs: only it can pause or draft fewer
        positions, and only its plans tell when drafting pays again."""
        if self.mode != "auto" or self.skip > 0 or self.backoff > 0 or not self.chain_within:
            return "tree"
        if self.draft_block < self.block_size:
            return "tree"  # (the chain drafts the whole block)
        return self.choice.choose()

    def observe_speed(self, kind: str, accepted: Sequence[int], seconds: float) -> None:
        """One cycle on the chain's path or a tree's took `seconds`; row r accepted accepted[r] draft tokens."""
        if self.costs is not None and kind == "chain":  # (a tree cycle's shape is learnt in observe)
            self.costs.observe(self.block_size, len(accepted), True, seconds, self.context)
        if self.costs is None or (kind == "tree" and (not self.last_drafted or self.drafted_block < self.block_size)):
            return  # (a cycle without a draft forward, or a shorter one, says nothing about either path's chain-sized
            # drafted cycles)
        rows = len(accepted)
        model = self.costs.cycle_seconds(self.block_size, rows, True, self.context)
        self.choice.observe(kind, seconds, model)

    def drafts_this_cycle(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def plan(self, anchors: Sequence[int], top_ids=None, top_probs=None,
             copies: Sequence[Sequence[int]] = ()) -> Plan:
        """Trees for this cycle. top_ids / top_probs (rows, B-1, k) host lists when the cycle drafted, else None."""
        self._age()
        rows = len(anchors)
        copies = list(copies) if self.copy_branch and copies else [[] for _ in range(rows)]
        drafted = top_ids is not None
        block = len(top_ids[0]) + 1 if drafted else self.block_size  # positions of this cycle's draft
        n = self.budget if self.mode == "tree" else self.reach
        candidates = []
        for r in range(rows):
            draft = best_first(top_ids[r], top_probs[r], n, self.block_size - 1) if drafted else []
            candidates.append(merge_candidates(draft, copies[r][: self.block_size - 1], self.calibration))
        if self.mode == "tree":
            counts = [min(self.budget, len(c)) for c in candidates]
        else:
            limit = self._limit(rows)
            counts, rate = self._counts(candidates, drafted, limit, block)
            if drafted:
                chains = [_chain_tokens(p[: self.block_size - 1], self.calibration) for p in top_probs]
                self.draft_block, rate = self._next_block(candidates, counts, rate, limit, block)
                self._update_pause(copies, rate, limit)
                self.chain_within = self._chain_within(chains, limit)
                # what this cycle's trees and the chain are each expected to commit
                self.choice.observe_plan([1.0 + sum(x.value for x in c[:k]) for c, k in zip(candidates, counts)],
                                         chains)
                self.reach = min(self.budget, max(2 * max(counts), 2 * (self.block_size - 1)))
        trees = [to_tree(a, c[:k]) for a, c, k in zip(anchors, candidates, counts)]
        qs = [[1.0] + [x.q for x in c[:k]] for c, k in zip(candidates, counts)]
        return Plan(trees, qs, drafted, block)

    def observe_plain(self, rows: int, seconds: float) -> None:
        """Learn from a plain cycle run without a plan (a pause with nothing to copy): what observing its root-only
        trees teaches, without building them. The calibration's forgetting waits for the next plan."""
        self.idle_trees += rows
        self.last_drafted = False
        self._timed(1, rows, False, seconds)

    def observe(self, plan: Plan, paths: Sequence[Sequence[int]], seconds: float | None = None) -> None:
        """Learn from one verified cycle: which nodes the target accepted, and (auto) how long the cycle took."""
        self._age()
        for tree, qs, path in zip(plan.trees, plan.qs, paths):
            self.calibration.observe(tree, qs, list(path))
        self.last_drafted = plan.drafted
        if seconds is not None:
            width = max(len(t.tokens) for t in plan.trees)
            self._timed(width, len(plan.trees), plan.drafted, seconds, plan.block)

    def _timed(self, width: int, rows: int, drafted: bool, seconds: float, block: int | None = None) -> None:
        """(auto) A cycle of `rows` rows verifying `width` tokens took `seconds`: the clock and the costs learn it."""
        if self.costs is not None:
            forwards = self.costs.cycle_seconds(width, rows, drafted, self.context, block)
            self.clock[drafted].observe(forwards, seconds)
            self.costs.observe(width, rows, drafted, seconds, self.context, block)

    def _age(self) -> None:
        if self.idle_trees:
            self.calibration.age(self.idle_trees)
            self.idle_trees = 0

    # ---- auto ------------------------------------------------------------------------------------------------------
    @property
    def auto_costs(self) -> Costs:
        """The measured costs auto chooses by (Engine.set_verify refuses auto without them)."""
        assert self.costs is not None, "--verify auto without measured costs"
        return self.costs

    def _counts(self, candidates, drafted: bool, limit: float | None,
                block: int | None = None) -> tuple[list[int], float]:
        values = [[c.value for c in cs] for cs in candidates]
        clock, costs = self.clock[drafted], self.auto_costs
        seconds = lambda n, r: clock(costs.cycle_seconds(n, r, drafted, self.context, block))  # noqa: E731
        return choose_counts(values, seconds, 0.0, self.budget, limit)

    def _next_block(self, candidates, counts, rate: float, limit: float | None, block: int) -> tuple[int, float]:
        """The next draft's positions, and the rate this cycle's plan predicts for them: the measured block whose best
        plan over recent cycles' candidates (draft nodes past its positions dropped; rates smoothed) is fastest with
        its own draft forward; at high load on a device that pays for every position, that is often a few positions.
        When the drafted block wins and its plan reaches its last position, the next block up is tried (again after
        2, 4 .. 64 drafted cycles while such tries lose)."""
        rates = {block: rate}
        for b in self.blocks:
            if b >= block:
                break
            kept = [[c for c in cs if c.copied or len(c.tokens) < b] for cs in candidates]
            rates[b] = self._counts(kept, True, limit, b)[1]
        for b, r in rates.items():  # smoothed: one cycle's text says little about which depth pays
            old = self.block_rates.get(b)
            self.block_rates[b] = r if old is None else old + BLOCK_SMOOTHING * (r - old)
        best = max(rates, key=self.block_rates.__getitem__)
        if self.block_rates[best] < (1 + BLOCK_MARGIN) * self.block_rates[block]:
            best = block  # (a shorter block must win clearly: it gives up deep nodes and the chain's own path)
        best_rate = rates[best]
        wait, after = self.deepen_wait, self.deepen_after
        for b in wait:
            wait[b] = max(wait[b] - 1, 0)
        if block > self.drafted_block:  # this cycle tried a deeper block: it lost (wait longer next time) or held
            after[block] = min(2 * after[block], MAX_PAUSE) if best < block else 1
            wait[block] = after[block] if best < block else 0
        self.drafted_block = block
        deepest = max((len(c.tokens) for cs, k in zip(candidates, counts) for c in cs[:k] if not c.copied), default=0)
        deeper = self.blocks[self.blocks.index(block) + 1] if block < self.block_size else None
        if best == block and deeper and deepest >= block - 1 and not wait[deeper]:
            if self._counts(candidates, True, limit, deeper)[1] > 0:  # (not when its draft alone breaks the limit)
                best = deeper
        return best, best_rate

    def _limit(self, rows: int) -> float | None:
        """Seconds a cycle may take per token its least-served row expects: itl_limit plain steps of this batch."""
        if not self.itl_limit:
            return None
        return self.itl_limit * self.clock[False](self.auto_costs.cycle_seconds(1, rows, False, self.context))

    def _chain_within(self, chains: Sequence[float], limit: float | None) -> bool:
        """Whether a chain cycle (every row verifies the drafter's B-1 rank-1 proposals) keeps within the limit: its
        tokens per row (`chains`) expected from the same calibrated values as the tree's."""
        if limit is None:
            return True
        rows, least = len(chains), min(chains)
        seconds = self.auto_costs.cycle_seconds(self.block_size, rows, True, self.context)
        return self.clock[True](seconds) <= limit * least

    def _update_pause(self, copies, drafted_rate: float, limit: float | None) -> None:
        """Compare the predicted rate of drafted cycles with what the same cycles would give without the draft
        forward (the copied branch alone), both smoothed over recent cycles so that one unsure draft does not stop
        a good drafter: pause drafting, for longer each time, while not drafting wins."""
        undrafted = [merge_candidates([], c[: self.block_size - 1], self.calibration) for c in copies]
        _, undrafted_rate = self._counts(undrafted, False, limit)
        if self.rates is None:
            self.rates = [drafted_rate, undrafted_rate]
        else:
            self.rates = [r + 0.3 * (x - r) for r, x in zip(self.rates, (drafted_rate, undrafted_rate))]
        if self.rates[1] > self.rates[0]:
            self.backoff = min(max(1, 2 * self.backoff), MAX_PAUSE)
            self.skip = self.backoff
        else:
            self.backoff = 0


class ChainBudget:
    """auto for rows that verify by rejection (chains only): how many of the B-1 sampled proposals a cycle verifies,
    and whether it drafts at all. Expected tokens of a chain of L proposals are 1 + sum_j prod_{i<=j} a_i with a_i
    the measured rate at which position i accepts when reached (an exponential average over recent cycles, under the
    rule in use); seconds are T_draft(L + 1 positions) + T_verify(L + 1) from the device profile (the draft fills
    only the positions verified), taken to the wall clock by a CycleClock fitted on the cycles' own times (either
    way: a profile measured while the machine was busy overstates). L = 0 is a plain target step without the draft
    forward; while it wins, drafting pauses for 1, 2, 4 .. 64 cycles between probes, as the tree planner's pauses do."""

    def __init__(self, block_size: int, costs: Costs, prior: float = 0.5, smoothing: float = 0.1):
        self.costs, self.smoothing = costs, smoothing
        self.rates = [prior] * (block_size - 1)
        self.clock = {True: CycleClock(smoothing), False: CycleClock(smoothing)}
        self.context: float | None = None  # cached positions of the batch's longest row this cycle (the engine's)
        self.skip, self.backoff, self.probing = 0, 0, False
        self.since_plain = 0  # drafted cycles since the last plain one

    def expected(self, length: int) -> float:
        tokens, reach = 1.0, 1.0
        for a in self.rates[:length]:
            reach *= a
            tokens += reach
        return tokens

    def forwards(self, length: int, rows: int = 1) -> float:
        """The profile's seconds for a cycle verifying `length` proposals per row (0: no draft forward)."""
        return self.costs.cycle_seconds(length + 1, rows, length > 0, self.context, length + 1)

    def seconds(self, length: int, rows: int = 1) -> float:
        return self.clock[length > 0](self.forwards(length, rows))

    def length(self, can_pause: bool = True, rows: int = 1) -> int:
        """Proposals every one of `rows` rows verifies this cycle (0: no draft forward; only when `can_pause`). The
        cycle after a pause drafts (a probe), so the acceptance estimates stay current."""
        if can_pause and (self.skip > 0 or self.since_plain >= PLAIN_EVERY):
            self.skip = max(self.skip - 1, 0)  # a pause; or a plain step now and then, to keep its time known
            return 0
        best = max(range(1, len(self.rates) + 1), key=lambda n: self.expected(n) / self.seconds(n, rows))
        if not can_pause:
            return best
        plain_wins = self.expected(0) / self.seconds(0, rows) > self.expected(best) / self.seconds(best, rows)
        if plain_wins and not self.probing:
            self.backoff = min(max(1, 2 * self.backoff), MAX_PAUSE)
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
        self.clock[drafted].observe(self.forwards(length, rows), seconds)
        self.costs.observe(length + 1, rows, drafted, seconds, self.context, length + 1)
