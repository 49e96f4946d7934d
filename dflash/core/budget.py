"""The tree planner: each row's draft nodes this cycle (`--verify tree`: a fixed budget, DDTree), and for `--verify
auto` the plan of the most expected tokens per second (calibrated acceptance, dflash.core.tree; the cycles' own
seconds, dflash/core/cycle_times.py) and what the next cycles run: a pause, a shorter draft, or the chain's path.
docs/verification.md says the policy, docs/trees.md what each part measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .cycle_times import CycleTimes
from .tree import Calibration, Tree, best_first, chain_value, choose_counts, merge_candidates, to_tree

VERIFY_MODES = ("chain", "tree", "auto")
MAX_TOP_K = 16  # draft candidates per depth the tree may branch over
DRAFT_BLOCKS = (2, 4, 8)  # auto: shorter draft forwards it may choose (where deep nodes do not pay)
MAX_PAUSE = 64  # the longest wait between probes of a path, a draft block, or a row's place in the draft forward
BATCH_PAUSE = 128  # ... and of drafting at all (its probe's draft forward reads every position the pause committed)
SMOOTHING = 0.2  # auto: weight of a cycle in a smoothed estimate (the candidates' rates, the paths' overheads)
BLOCK_MARGIN = 0.1  # auto: how much faster a shorter draft block must be predicted to be to replace the drafted one
AUTO_BUDGET = 255  # auto: the most draft nodes a row's tree may have (the seconds it learns choose fewer)
ITL_LIMIT = 1.5  # auto: a cycle takes at most this many plain steps per token its least-served row expects


def _outran(plan: "Plan", paths: Sequence[Sequence[int]]) -> int:
    """The depth of the shallowest row's deepest drafted node when the target accepted every row's (rows drafting
    less than 2 deep aside), else 0: the drafter did better than the q its plan was priced by."""
    depths = []
    for tree, qs, path in zip(plan.trees, plan.qs, paths):
        deepest = max((d for d, q in zip(tree.depths, qs) if q > 0), default=0)
        if deepest >= 2:
            if max((tree.depths[i] for i in path), default=0) < deepest:
                return 0
            depths.append(deepest)
    return min(depths, default=0)


@dataclass
class Plan:
    trees: list[Tree]
    qs: list[list[float]]  # per row and node: the surrogate probability (0 for copied-only nodes)
    drafted: bool
    block: int  # positions of the cycle's draft forward
    draft_rows: int | None = None  # rows the draft forward ran for, when not all


@dataclass
class Pause:
    """Waits between probes of what lost: 1, 2, 4 .. `longest` cycles, twice as long after each probe that loses,
    none after one that wins. The batch's drafting (TreePlanner, ChainBudget), a row's place in the draft forward
    (its Row), the path not taken, a deeper draft block."""

    skip: int = 0  # cycles left in this pause
    backoff: int = 0  # the last pause's length (0: drafting won)
    longest: int = MAX_PAUSE

    @property
    def going(self) -> bool:
        """Whether the next cycle is in the pause too."""
        return self.skip > 0

    def waits(self) -> bool:
        """Whether this cycle is in the pause (counted down)."""
        if self.skip:
            self.skip -= 1
            return True
        return False

    def observe(self, drafting_wins: bool) -> None:
        if drafting_wins:
            self.backoff = 0
        else:
            self.backoff = min(max(1, 2 * self.backoff), self.longest)
            self.skip = self.backoff


class TreePlanner:
    """Builds each cycle's trees (one per row) and learns from what the target accepted."""

    def __init__(self, mode: str, block_size: int, budget: int, times: CycleTimes | None = None,
                 copy_branch: bool = True, itl_limit: float | None = ITL_LIMIT):
        self.mode, self.block_size, self.budget, self.times = mode, block_size, budget, times
        self.copy_branch, self.itl_limit = copy_branch, itl_limit
        self.top_k = min(MAX_TOP_K, budget)
        self.reach = min(budget, 2 * (block_size - 1))  # auto: candidates per row, twice the most verified last cycle
        self.calibration = Calibration(block_size - 1)
        self.idle_trees = 0  # root-only trees of plain cycles not yet forgotten by (Calibration.age) the calibration
        self.pause = Pause(longest=BATCH_PAUSE)  # auto: the batch's cycles without a draft forward
        # auto: the path whose cycles run, the other's probes, each path's seconds over the cycle times' (overhead)
        self.best_path, self.path_probes = "tree", Pause(skip=1)
        self.chain_within = True  # whether the last whole-block plan's chain kept within the ITL limit
        self.path_factor, self.path_cycles = {"chain": 1.0, "tree": 1.0}, {"chain": 0, "tree": 0}
        self.last_drafted = True
        self.blocks = sorted({b for b in (DRAFT_BLOCKS if times else ()) if b < block_size} | {block_size})
        self.draft_block = self.drafted_block = block_size  # auto: positions of the next draft forward
        self.rates: dict[int | str, float] = {}  # auto: smoothed predicted tokens/s of each candidate (_choose)
        self.deepen = {b: Pause() for b in self.blocks}  # auto: drafted cycles before a block is tried from below
        self.draft_rows: int | None = None  # auto: rows of this cycle's draft forward, when not all
        self.last_trees: list[Tree] = []  # the last cycle's trees and accepted paths (introspection: tests, traces)
        self.last_paths: list[list[int]] = []

    def path(self, pauses: Sequence[Pause] = ()) -> str:
        """auto: "chain" or "tree" for this cycle (tree: always), the rows' own pauses in `pauses`: the path the last
        whole-block plan found faster, the other probed now and then (Pause). While a pause, a row's or the batch's,
        or a shorter draft wins, the tree's: the chain drafts every row the whole block."""
        if self.mode != "auto" or self.pause.skip or self.pause.backoff or not self.chain_within or any(
                p.skip for p in pauses) or self.draft_block < self.block_size:
            return "tree"
        if self.path_probes.waits():
            return self.best_path
        self.path_probes.observe(False)  # (the next probe waits twice as long)
        return "chain" if self.best_path == "tree" else "tree"

    def observe_chain(self, rows: int, seconds: float) -> None:
        """(auto) A cycle of `rows` rows on the chain's path took `seconds`."""
        self.auto_times.observe(self.block_size, rows, True, seconds)
        self._path_seconds("chain", self.block_size, rows, seconds)

    def drafts_this_cycle(self) -> bool:
        return not self.pause.waits()

    def drafting_rows(self, pauses: Sequence[Pause]) -> list[int] | None:
        """auto: the rows a drafted cycle drafts for, by their own pauses, whose waits count down ([]: none; None: all,
        none pausing)."""
        if self.mode != "auto" or len(pauses) == 1:
            return None
        return [r for r, pause in enumerate(pauses) if not pause.waits()]

    def reset(self) -> None:
        """A new request (or batch): it drafts at once, judged on its own text (a pause's length is kept)."""
        self.pause.skip = 0
        self.rates.clear()

    def plan(self, anchors: Sequence[int], top_ids=None, top_probs=None,
             copies: Sequence[Sequence[int]] = (), drafting: Sequence[int] | None = None,
             pauses: Sequence[Pause] = ()) -> Plan:
        """Trees for this cycle. top_ids / top_probs (rows, B-1, k) host lists when the cycle drafted, else None;
        `drafting`: drafting_rows' answer, the rows they are of, whose pauses (in `pauses`) learn from the plan."""
        self._age()
        rows = len(anchors)
        copies = list(copies) if self.copy_branch and copies else [[] for _ in range(rows)]
        drafted = top_ids is not None
        block = len(top_ids[0]) + 1 if drafted else self.block_size  # positions of this cycle's draft
        if drafted and drafting is not None:  # (a row without a draft has none of its own: its copied branch only)
            ids, probs = [None] * rows, [None] * rows
            for j, r in enumerate(drafting):
                ids[r], probs[r] = top_ids[j], top_probs[j]
            top_ids, top_probs = ids, probs
        self.draft_rows = len(drafting) if drafted and drafting is not None and len(drafting) < rows else None
        n = self.budget if self.mode == "tree" else self.reach
        candidates = []
        for r in range(rows):
            draft = best_first(top_ids[r], top_probs[r], n, self.block_size - 1) \
                if drafted and top_ids[r] is not None else []
            candidates.append(merge_candidates(draft, copies[r][: self.block_size - 1], self.calibration))
        if self.mode == "tree":
            counts = [min(self.budget, len(c)) for c in candidates]
        else:
            limit = self._limit(rows)
            counts, rate = self._counts(candidates, drafted, limit, block)
            if drafted:
                self._choose(candidates, counts, limit, block, rate, copies, top_ids, top_probs)
                given = {r: any(not c.copied for c in candidates[r][:counts[r]]) for r in drafting or ()}
                if any(given.values()):  # (no row given one: the whole batch's pause)
                    for r, drafted_nodes in given.items():
                        pauses[r].observe(drafted_nodes)
                self.reach = min(self.budget, max(2 * max(counts), 2 * (self.block_size - 1)))
        trees = [to_tree(a, c[:k]) for a, c, k in zip(anchors, candidates, counts)]
        qs = [[1.0] + [x.q for x in c[:k]] for c, k in zip(candidates, counts)]
        return Plan(trees, qs, drafted, block, self.draft_rows)

    def observe_plain(self, rows: int, seconds: float) -> None:
        """Learn from a plain cycle run without a plan (a pause with nothing to copy) what its root-only trees teach
        (the calibration forgets them at the next plan)."""
        self.idle_trees += rows
        self.last_drafted = False
        self.last_trees, self.last_paths = [], [[] for _ in range(rows)]
        # (a pause's cycles are alike: one in 8 keeps the plain step's seconds current at a tenth of the host work)
        if self.times is not None and self.pause.skip % 8 == 0:
            self.times.observe(1, rows, False, seconds)

    def observe(self, plan: Plan, paths: Sequence[Sequence[int]], seconds: float | None = None) -> None:
        """Learn from one verified cycle: which nodes the target accepted, and (auto) how long the cycle took."""
        self._age()
        self.last_trees, self.last_paths = plan.trees, [list(p) for p in paths]
        for tree, qs, path in zip(plan.trees, plan.qs, paths):
            self.calibration.observe(tree, qs, list(path))
        probe = plan.drafted and not self.last_drafted
        self.last_drafted = plan.drafted
        width = max(len(t.tokens) for t in plan.trees)
        reached = _outran(plan, paths) if self.mode == "auto" and plan.drafted else 0
        if reached and self._paid(plan, width, paths):  # (a pause this plan chose was the q's mistake: docs/trees.md)
            self.pause.skip = self.pause.backoff = 0
            deeper = self._deeper(plan.block)
            if deeper and reached == plan.block - 1 and len(plan.trees) == 1:  # one row took all its short block
                self.draft_block, self.deepen[deeper] = deeper, Pause()  # gave: deeper at once (a batch's short
                # block is chosen for its cost)
        # (a probe's draft forward also reads every position its pause committed: not a drafted cycle's cost)
        if self.times is not None and seconds is not None and not probe:
            self.times.observe(width, len(plan.trees), plan.drafted, seconds, plan.block, plan.draft_rows)
            if plan.drafted and plan.block == self.block_size and plan.draft_rows is None:
                self._path_seconds("tree", width, len(plan.trees), seconds)

    def _path_seconds(self, path: str, width: int, rows: int, seconds: float) -> None:
        """(auto) A whole-block drafted cycle on `path`: its seconds over its shape's, smoothed, are the path's own
        overhead (host read, tree building, mask)."""
        self.path_cycles[path] += 1
        if self.path_cycles[path] > 1:  # (a path's first cycle warms it up: allocation, kernel selection)
            old = self.path_factor[path]
            self.path_factor[path] = old + SMOOTHING * (seconds / self.auto_times.cycle_seconds(width, rows) - old)

    def _age(self) -> None:
        if self.idle_trees:
            self.calibration.age(self.idle_trees)
            self.idle_trees = 0

    # ---- auto ------------------------------------------------------------------------------------------------------
    @property
    def auto_times(self) -> CycleTimes:
        """The cycle times auto chooses by (auto's planner always has them)."""
        assert self.times is not None, "--verify auto without cycle times"
        return self.times

    def _counts(self, candidates, drafted: bool, limit: float | None,
                block: int | None = None) -> tuple[list[int], float]:
        values = [[c.value for c in cs] for cs in candidates]
        times, some = self.auto_times, self.draft_rows
        seconds = lambda n, r: times.cycle_seconds(n, r, drafted, block, some)  # noqa: E731
        return choose_counts(values, seconds, 0.0, self.budget, limit)

    def _choose(self, candidates, counts, limit: float | None, block: int, rate: float, copies, top_ids,
                top_probs) -> None:
        """Sets the next cycles' pause, path and draft block from the smoothed rates (tokens per second) this plan
        predicts for drafting `block` positions (`rate`), the copied branch alone ("plain"), the chain's path ("chain")
        and each shorter block (docs/trees.md)."""
        undrafted = [merge_candidates([], c[: self.block_size - 1], self.calibration) for c in copies]
        rates: dict[int | str, float] = {block: rate, "plain": self._counts(undrafted, False, limit)[1]}
        if block == self.block_size:
            rates["chain"] = self._chain_rate([chain_value(i, p, c, self.calibration) if p is not None else 1.0
                                               for i, p, c in zip(top_ids, top_probs, copies)], limit)
        for b in self.blocks:
            if b >= block:
                break
            kept = [[c for c in cs if c.copied or len(c.tokens) < b] for cs in candidates]
            rates[b] = self._counts(kept, True, limit, b)[1]
        first = "plain" not in self.rates
        for key, r in rates.items():
            old = self.rates.get(key)
            self.rates[key] = r if old is None else old + SMOOTHING * (r - old)
        smoothed = self.rates.__getitem__
        whole = max(rates.keys() & {block, "chain"}, key=smoothed)
        best = max(rates.keys() - {"plain"}, key=smoothed)
        if smoothed(best) < (1 + BLOCK_MARGIN) * smoothed(whole):
            best = whole  # (a shorter block must win clearly: it gives up deep nodes and the chain's own path)
        wins = smoothed("plain") <= smoothed(best)
        if not wins and first and self.pause.backoff < BATCH_PAUSE:  # one more look before a pause as long as the
            self.pause.skip = 1  # last request's (after the longest pause, the last text was that look: all lost)
        else:
            self.pause.observe(wins)
        if "chain" in rates:  # (a plan of the whole block chooses the path too)
            self.chain_within = rates["chain"] > 0
            path = "chain" if best == "chain" else "tree"
            if path != self.best_path:  # (the other path is probed again soon)
                self.best_path, self.path_probes = path, Pause(skip=1)
        if best == "chain":
            best = block
        assert isinstance(best, int)  # (the chain's path drafts the whole block)
        for pause in self.deepen.values():
            pause.waits()
        if block > self.drafted_block:  # this cycle tried a deeper block: it lost (a longer wait next time) or held
            self.deepen[block].observe(best == block)
        self.drafted_block = block
        # (a drafted node the copied branch also holds counts: the drafter reached that deep)
        deepest = max((len(c.tokens) for cs, k in zip(candidates, counts) for c in cs[:k] if c.ranks), default=0)
        deeper = self._deeper(block)
        if best == block and deeper and deepest >= block - 1 and not self.deepen[deeper].skip:
            if self._counts(candidates, True, limit, deeper)[1] > 0:  # (not when its draft alone breaks the limit)
                best = deeper
        self.draft_block = best

    def _paid(self, plan: Plan, width: int, paths: Sequence[Sequence[int]]) -> bool:
        """Whether the tokens a drafted cycle of `width` tokens a row committed, at its shape's price, beat the copied
        branch alone's rate (every drafted node accepted is not enough where the draft costs more than they save)."""
        seconds = self.auto_times.cycle_seconds(width, len(plan.trees), True, plan.block, plan.draft_rows)
        return sum(len(p) + 1 for p in paths) / seconds > self.rates.get("plain", 0.0)

    def _deeper(self, block: int) -> int | None:
        """The measured draft block after `block` (None after the whole block)."""
        return self.blocks[self.blocks.index(block) + 1] if block < self.block_size else None

    def _limit(self, rows: int) -> float | None:
        """Seconds a cycle may take per token its least-served row expects: itl_limit plain steps of this batch."""
        if not self.itl_limit:
            return None
        return self.itl_limit * self.auto_times.cycle_seconds(1, rows, False)

    def _chain_rate(self, chains: Sequence[float], limit: float | None) -> float:
        """Tokens per second of a cycle on the chain's path, row r expected to commit chains[r]; 0 over the limit."""
        seconds = self.auto_times.cycle_seconds(self.block_size, len(chains), True)
        if limit is not None and seconds > limit * min(chains):
            return 0.0
        return sum(chains) / seconds * self.path_factor["tree"] / self.path_factor["chain"]
