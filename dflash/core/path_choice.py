"""--verify auto's choice between the chain's own path and a tree's, cycle by cycle.

The chain's path runs draft and verify with no host read between them (on a lazy backend the draft overlaps the
verify's graph building); a tree cycle reads the draft's top-k, builds the tree and verifies it under a 4D mask.
Which is faster is estimated, not raced (measured speeds swing with the text far more than between the paths):

- Seconds: each path's cycles, smoothed as a multiple of the cycle times' prediction for their own shape, so that
  the factor is the path's own overhead (host read, tree building, mask), not its size.
- Tokens: each drafted tree cycle's plan gives what its trees are expected to commit and what the chain would, from
  the same calibration; the estimate is the ratio of their decaying sums, each over its own decaying seconds.
- Probes: the path not in use runs one cycle after 16 cycles, then after 32, 64 .. 1024 while it loses by more than
  10% (back to 16 when the two are close or the choice flips). The first cycle of each path only warms up.

docs/trees.md has the measurements behind each choice.
"""

from __future__ import annotations

from typing import Sequence

PROBE_FIRST, PROBE_LAST = 16, 1024  # cycles before the path not in use runs once (doubling while it loses)
CLOSE = 0.1  # paths whose estimates are this close are probed again soon


class PathChoice:
    def __init__(self, warmup: int = 3, smoothing: float = 0.2, decay: float = 0.9):
        self.warmup, self.smoothing, self.decay = warmup, smoothing, decay
        self.factor: dict[str, float | None] = {"chain": None, "tree": None}  # seconds / the model's, own shape
        self.cycles = {"chain": 0, "tree": 0}
        self.tokens = [0.0, 0.0]  # decaying sums over drafted tree cycles' rows: expected tree and chain tokens
        self.seconds = [0.0, 0.0]  # ... and over those cycles: the cost model's seconds of the tree's and the chain's
        self.best, self.since, self.wait = "tree", 0, PROBE_FIRST

    def ratio(self) -> float:
        """Estimated tree speed over chain speed."""
        tree, chain = self.tokens
        gain = tree / chain if chain > 0 else 1.0
        tree_seconds, chain_seconds = self.seconds
        shapes = chain_seconds / tree_seconds if tree_seconds > 0 and chain_seconds > 0 else 1.0
        chain_factor, tree_factor = self.factor["chain"], self.factor["tree"]
        assert chain_factor is not None and tree_factor is not None, "choose() asks only once both are measured"
        return gain * shapes * chain_factor / tree_factor

    def chain_gain(self) -> float:
        """How many times faster the chain's path is estimated than the tree's at the whole block (1.0 while it is not,
        or while either path is unmeasured): what a shorter draft block, whose cycles run on a tree's path, must
        beat."""
        if any(self.cycles[k] < self.warmup or self.factor[k] is None for k in self.cycles):
            return 1.0
        return max(1.0, 1.0 / self.ratio())

    def choose(self) -> str:
        for kind in ("tree", "chain"):
            if self.cycles[kind] < self.warmup or self.factor[kind] is None:
                return kind
        ratio = self.ratio()
        best = "tree" if ratio > 1.0 else "chain"
        if best != self.best:
            self.best, self.since, self.wait = best, 0, PROBE_FIRST
        self.since += 1
        if self.since < self.wait:
            return best
        self.since = 0  # the other path's estimate is stale: one cycle on it
        self.wait = PROBE_FIRST if abs(ratio - 1.0) < CLOSE else min(2 * self.wait, PROBE_LAST)
        return "chain" if best == "tree" else "tree"

    def observe(self, kind: str, seconds: float, model_seconds: float) -> None:
        """One cycle of `kind` took `seconds`; the cost model predicts `model_seconds` for a cycle of its shape."""
        self.cycles[kind] += 1
        if self.cycles[kind] == 1:
            return  # (allocation, kernel selection)
        x, old = seconds / max(model_seconds, 1e-9), self.factor[kind]
        self.factor[kind] = x if old is None else old + self.smoothing * (x - old)

    def observe_plan(self, tree: Sequence[float], chain: Sequence[float], seconds: tuple[float, float]) -> None:
        """A drafted tree cycle's plan: per row, the tokens its tree is expected to commit, and the chain's; the cost
        model's seconds of the cycle that verifies the trees and of a chain cycle."""
        d = self.decay
        self.tokens = [d * self.tokens[0] + sum(tree), d * self.tokens[1] + sum(chain)]
        self.seconds = [d * self.seconds[0] + seconds[0], d * self.seconds[1] + seconds[1]]
