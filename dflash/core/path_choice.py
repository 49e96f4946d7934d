"""--verify auto's choice between the chain's own path and a tree's, cycle by cycle.

The chain's path runs draft and verify with no host read between them (on a lazy backend the draft overlaps the
verify's graph building); a tree cycle reads the draft's top-k, builds the tree and verifies it under a 4D mask. Which
is faster depends on the device and the drafter, so it is estimated, not raced: measured speeds swing with the text
far more than between the two paths, and re-trying the slower path to keep its speed current costs what it loses.

- Seconds: each path's cycles are smoothed as a multiple of the cost model's chain cycle at that many rows, so the
  estimates carry over as the batch grows and shrinks.
- Tokens: a tree cycle also tells what the chain would have committed. In greedy verification the chain's proposals
  are the drafter's rank-1 tokens, so the chain accepts exactly the accepted path's leading rank-1 nodes; where the
  tree verified all of its rank-1 nodes and accepted them, the chain's continuation is expected from the per-depth
  rates at which the chain's proposals are accepted once reached (learnt from both paths' cycles).
- Probes: the path not in use runs one cycle after 16 cycles, then after 32, 64 .. 1024 while it loses by more than
  10% (back to 16 when the two are close or the choice flips). The first cycle of each path only warms up.
"""

from __future__ import annotations

from typing import Sequence

PROBE_FIRST, PROBE_LAST = 16, 1024  # cycles before the path not in use runs once (doubling while it loses)
CLOSE = 0.1  # paths whose estimates are this close are probed again soon


class PathChoice:
    def __init__(self, block_size: int, warmup: int = 3, smoothing: float = 0.2, prior: float = 0.5):
        self.warmup, self.smoothing = warmup, smoothing
        self.factor: dict[str, float | None] = {"chain": None, "tree": None}  # seconds / the model's chain cycle
        self.cycles = {"chain": 0, "tree": 0}
        self.rates = [prior] * (block_size - 1)  # P(the chain's proposal at depth d is accepted | reached)
        self.tokens = [0.0, 0.0]  # decaying sums over tree cycles: committed, and what the chain would have
        self.best, self.since, self.wait = "tree", 0, PROBE_FIRST

    def ratio(self) -> float:
        """Estimated tree speed over chain speed."""
        tree, chain = self.tokens
        gain = tree / chain if chain > 0 else 1.0
        return gain * self.factor["chain"] / self.factor["tree"]

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
        """One cycle of `kind` took `seconds`; the cost model predicts `model_seconds` for a chain cycle."""
        self.cycles[kind] += 1
        if self.cycles[kind] == 1:
            return  # (allocation, kernel selection)
        x, old = seconds / max(model_seconds, 1e-9), self.factor[kind]
        self.factor[kind] = x if old is None else old + self.smoothing * (x - old)

    def observe_chain(self, accepted: Sequence[int], verified: int) -> None:
        """A chain cycle: every row verified `verified` proposals and accepted accepted[r]."""
        for k in accepted:
            self._learn(k, verified)

    def observe_tree(self, on_chain: Sequence[Sequence[bool]], paths: Sequence[Sequence[int]],
                     decay: float = 0.9) -> None:
        """A drafted tree cycle: per row, which nodes are the drafter's rank-1 chain (root included) and the
        accepted path (node indices)."""
        tree = chain = 0.0
        for flags, path in zip(on_chain, paths):
            k, verified = 0, sum(flags) - 1
            while k < len(path) and flags[path[k]]:
                k += 1
            self._learn(k, verified)
            chain += 1.0 + k + (self.continuation(k) if k == verified else 0.0)
            tree += 1.0 + len(path)
        self.tokens = [decay * self.tokens[0] + tree, decay * self.tokens[1] + chain]

    def continuation(self, depth: int) -> float:
        """Expected further proposals the chain accepts once its first `depth` are accepted."""
        extra, reach = 0.0, 1.0
        for a in self.rates[depth:]:
            reach *= a
            extra += reach
        return extra

    def _learn(self, accepted: int, verified: int, s: float = 0.05) -> None:
        for i in range(min(accepted + 1, verified)):  # depth i + 1 was reached; accepted unless i == accepted
            self.rates[i] += s * ((1.0 if i < accepted else 0.0) - self.rates[i])
