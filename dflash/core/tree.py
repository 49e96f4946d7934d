"""Draft trees (DDTree, arXiv 2604.12989): which draft tokens one target forward verifies, and which it accepts.

A DFlash draft gives a distribution at every block position. Under the surrogate "a prefix u is accepted with
probability q(u) = prod_i q_i(u_i)" the expected number of accepted draft tokens of a tree is the sum of q over its
nodes, so the best tree of n nodes is the n most probable prefixes: a best-first heap over per-depth ranks yields them
in non-increasing q, parents before children. A branch copied from the context (the continuation of the latest
n-gram match, as prompt lookup does) may join it at no draft cost.

The budget (how many nodes to verify) maximises expected committed tokens per second: (1 + sum of the chosen nodes'
acceptance estimates) / (T_draft + T_verify(nodes + 1)). The estimates are the surrogate calibrated online per depth
against what the target accepted, so an overconfident drafter earns small trees; the seconds are learnt from the
engine's own cycles (dflash/core/cycle_times.py). Pure Python, backend-neutral; the engine turns a Tree into one
forward.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class Tree:
    """Nodes in verify order: index 0 is the root (the anchor, already committed), parents before children."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    values: list[float]  # estimated probability that the node is accepted (root: 1)
    copied: list[bool]  # the node is on the branch copied from the context

    @classmethod
    def root(cls, anchor: int) -> "Tree":
        return cls([anchor], [-1], [0], [1.0], [False])

    @property
    def nodes(self) -> int:
        """Draft nodes the target verifies (the root excluded)."""
        return len(self.tokens) - 1

    def mask(self) -> list[list[bool]]:
        """mask[i][j]: node i attends to node j (j is i or one of its ancestors)."""
        rows: list[list[bool]] = []
        for i, parent in enumerate(self.parents):
            row = rows[parent][:] if parent >= 0 else [False] * len(self.tokens)
            row[i] = True
            rows.append(row)
        return rows

    def paths(self) -> list[list[int]]:
        """paths[i]: the tokens from the root to node i, inclusive (the history node i's target token follows)."""
        out: list[list[int]] = []
        for i, parent in enumerate(self.parents):
            out.append((out[parent] if parent >= 0 else []) + [self.tokens[i]])
        return out

    def children(self, width: int) -> tuple[list[list[int]], list[list[float]]]:
        """Per slot (nodes, then padding up to `width`) its children's tokens in node order (a token's first node,
        as walk takes it), padded to the most children by repeating the first (0 for a leaf), and a 0/1 mask of the
        real ones: the candidates multi-candidate rejection tries (dflash.core.rules.multi_candidate_tokens)."""
        kids: list[list[int]] = [[] for _ in range(width)]
        for i in range(1, len(self.tokens)):
            siblings = kids[self.parents[i]]
            if self.tokens[i] not in siblings:
                siblings.append(self.tokens[i])
        m = max(1, max(map(len, kids)))
        return ([k + [k[0] if k else 0] * (m - len(k)) for k in kids],
                [[1.0] * len(k) + [0.0] * (m - len(k)) for k in kids])

    def walk(self, target: Sequence[int]) -> tuple[list[int], int]:
        """Descend from the root while the target's token at the current node is one of its children's tokens.
        Returns the accepted nodes (root excluded) and the bonus token: the target's token with no matching child."""
        children: dict[tuple[int, int], int] = {}
        for i in range(1, len(self.tokens)):
            children.setdefault((self.parents[i], self.tokens[i]), i)
        node, path = 0, []
        while (node, target[node]) in children:
            node = children[(node, target[node])]
            path.append(node)
        return path, target[node]


@dataclass
class Candidate:
    ranks: tuple[int, ...]  # the draft rank chosen at each depth ((), for a copied node off the draft's top-k)
    tokens: tuple[int, ...]  # its prefix of tokens
    q: float  # surrogate probability (product of draft marginals; 0 for a copied node outside the top-k)
    value: float = 0.0
    copied: bool = False


def best_first(top_ids: Sequence[Sequence[int]], top_probs: Sequence[Sequence[float]], n: int,
               max_depth: int) -> list[Candidate]:
    """The n most probable prefixes under the product of per-depth marginals, in non-increasing probability
    (parents before children). top_ids[d] / top_probs[d]: depth d+1's top-k, most probable first."""
    depth_limit = min(max_depth, len(top_ids))
    if n <= 0 or depth_limit <= 0:
        return []
    logp = [[math.log(max(p, 1e-30)) for p in row] for row in top_probs]
    k = len(logp[0])
    heap: list[tuple[float, tuple[int, ...]]] = [(-logp[0][0], (0,))]
    out: list[Candidate] = []
    while heap and len(out) < n:
        neg, ranks = heapq.heappop(heap)
        d = len(ranks) - 1
        out.append(Candidate(ranks, tuple(top_ids[i][r] for i, r in enumerate(ranks)), math.exp(-neg)))
        if ranks[-1] + 1 < k:  # next sibling
            heapq.heappush(heap, (neg + logp[d][ranks[-1]] - logp[d][ranks[-1] + 1], ranks[:-1] + (ranks[-1] + 1,)))
        if d + 1 < depth_limit:  # first child
            heapq.heappush(heap, (neg - logp[d + 1][0], ranks + (0,)))
    return out


class CopyIndex:
    """Prompt lookup over one row's tokens: the continuation after the latest earlier occurrence of the longest
    n-gram (max_ngram .. 1) that ends the sequence. Incremental: each token is indexed once. Where the continuation
    reaches the sequence's end before `length` tokens, it goes on copying itself (an overlapping copy, as LZ77's):
    text that repeats with a period p predicts its next p, 2p .. tokens, not only p. (Greedy decoding falls into such
    loops; the reference pair on one held-out prompt: a 7-token period, the copied branch cut at 7 nodes, so that
    pauses committed 8 tokens a cycle where the chain committed 11.6.)"""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its latest occurrence but the final

    def update(self, tokens: Sequence[int]) -> None:
        """Bring the index to `tokens` (the row's committed tokens; a shorter or different list starts over)."""
        n = len(self.tokens)
        if len(tokens) < n or (n and tokens[n - 1] != self.tokens[n - 1]):
            self.tokens, self.last, n = [], {}, 0
        for t in tokens[n:]:
            # the n-grams ending before t point at t: the sequence's own final n-gram is indexed only once a
            # later token follows it, so it never matches itself
            end = len(self.tokens)
            for g in range(1, self.max_ngram + 1):
                if end >= g:
                    self.last[tuple(self.tokens[end - g:end])] = end
            self.tokens.append(t)

    def continuation(self, length: int) -> list[int]:
        end = len(self.tokens)
        for g in range(min(self.max_ngram, end), 0, -1):
            at = self.last.get(tuple(self.tokens[end - g:]))
            if at is not None:
                out = self.tokens[at:at + length]
                period = end - at
                while len(out) < length:
                    out.append(out[len(out) - period])
                return out
        return []


@dataclass
class Calibration:
    """Online per-depth calibration of acceptance estimates, with exponential forgetting.

    Draft nodes: value = q * (accepted + prior) / (predicted + prior), where `predicted` sums the q of the verified
    nodes at that depth and `accepted` counts the depth's accepted node. Copied nodes: value = the observed rate at
    which a copied node at that depth was accepted (a 0.5**depth prior)."""

    depths: int
    decay: float = 0.98
    prior: float = 1.0
    predicted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    copy_offered: list[float] = field(default_factory=list)
    copy_accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        for name in ("predicted", "accepted", "copy_offered", "copy_accepted"):
            setattr(self, name, [0.0] * (self.depths + 1))

    def scale(self, depth: int) -> float:
        return (self.accepted[depth] + self.prior) / (self.predicted[depth] + self.prior)

    def age(self, trees: int) -> None:
        """Forget as `trees` observations of trees without a node do (one per row of a plain cycle)."""
        factor = self.decay ** trees
        for series in (self.predicted, self.accepted, self.copy_offered, self.copy_accepted):
            for d in range(len(series)):
                series[d] *= factor

    def copy_rate(self, depth: int) -> float:
        return (self.copy_accepted[depth] + self.prior * 0.5 ** depth) / (self.copy_offered[depth] + self.prior)

    def observe(self, tree: "Tree", qs: list[float], path: list[int]) -> None:
        self.age(1)
        on_path = set(path)
        for i in range(1, len(tree.tokens)):
            d = tree.depths[i]
            if qs[i] > 0:
                self.predicted[d] += qs[i]
                self.accepted[d] += i in on_path
            if tree.copied[i]:
                self.copy_offered[d] += 1
                self.copy_accepted[d] += i in on_path


def merge_candidates(draft: list[Candidate], copy: Sequence[int], calibration: Calibration) -> list[Candidate]:
    """Calibrated draft candidates plus the copied branch, one candidate per distinct prefix, sorted so that the
    first n of them always form a tree (every node's value is capped by its parent's; ties go to the shallower)."""
    by_prefix: dict[tuple[int, ...], Candidate] = {}
    for c in draft:
        c.value = c.q * calibration.scale(len(c.tokens))
        by_prefix[c.tokens] = c
    for d in range(1, len(copy) + 1):
        prefix = tuple(copy[:d])
        rate = calibration.copy_rate(d)
        drafted = by_prefix.get(prefix)
        if drafted is None:
            by_prefix[prefix] = Candidate((), prefix, 0.0, rate, True)
        else:
            drafted.value, drafted.copied = max(drafted.value, rate), True
    ordered = sorted(by_prefix.values(), key=lambda c: len(c.tokens))
    for c in ordered:  # shallow first: parents are capped before their children
        parent = by_prefix.get(c.tokens[:-1])
        if parent is not None:
            c.value = min(c.value, parent.value)
        elif len(c.tokens) > 1:
            c.value = 0.0  # an orphan (its parent fell outside the heap's n): never chosen before its parent
    return sorted((c for c in ordered if c.value > 0 or not c.copied),
                  key=lambda c: (-c.value, len(c.tokens)))


def chain_value(top_ids: Sequence[Sequence[int]], top_probs: Sequence[Sequence[float]], copy: Sequence[int],
                calibration: Calibration) -> float:
    """Tokens a chain cycle is expected to commit: 1 + the calibrated values of the drafter's rank-1 nodes at every
    depth, valued as merge_candidates values them (the copied branch's rate where the rank-1 prefix is the copied
    one, as the tree's merged node is), capped by the parent's value."""
    total, q, value, copied = 1.0, 1.0, math.inf, True
    for depth, (ids, probs) in enumerate(zip(top_ids, top_probs), start=1):
        q *= probs[0]
        node = q * calibration.scale(depth)
        copied = copied and depth <= len(copy) and copy[depth - 1] == ids[0]
        if copied:
            node = max(node, calibration.copy_rate(depth))
        value = min(value, node)
        total += value
    return total


def to_tree(anchor: int, chosen: Sequence[Candidate]) -> Tree:
    tree = Tree.root(anchor)
    index: dict[tuple[int, ...], int] = {(): 0}
    for c in chosen:
        index[c.tokens] = len(tree.tokens)
        tree.tokens.append(c.tokens[-1])
        tree.parents.append(index[c.tokens[:-1]])
        tree.depths.append(len(c.tokens))
        tree.values.append(c.value)
        tree.copied.append(c.copied)
    return tree


def chain_tree(anchor: int, proposals: Sequence[int]) -> Tree:
    """The chain as a tree: node d is proposal d, child of node d-1."""
    n = len(proposals)
    return Tree([anchor, *proposals], list(range(-1, n)), list(range(n + 1)), [1.0] * (n + 1), [False] * (n + 1))


def choose_counts(values: Sequence[Sequence[float]], verify_seconds: Callable[[int, int], float],
                  draft_seconds: float, cap: int, limit: float | None = None) -> tuple[list[int], float]:
    """How many of each row's sorted candidates to verify: the global prefix (by value across rows, each row
    keeping a prefix of its own) that maximises expected committed tokens per second. One forward verifies every
    row's root + nodes, padded to the widest row: verify_seconds(width + 1, rows). `limit`: the most seconds a
    cycle may take per token its least-served row expects (a row whose nodes are rarely accepted still waits for
    the whole cycle); plans over it are not taken. Returns the per-row counts and the predicted tokens per second
    (0.0 when no plan is within the limit)."""
    rows = len(values)
    pool = sorted(((v, r, i) for r, vs in enumerate(values) for i, v in enumerate(vs[:cap])),
                  key=lambda x: (-x[0], x[2]))
    seconds = [draft_seconds + verify_seconds(1, rows)]  # by width: the pool may hold thousands of candidates
    counts, width, expected = [0] * rows, 0, float(rows)
    row_expected, least = [1.0] * rows, 1.0  # per row: 1 (the bonus) + its chosen nodes' values; their minimum
    within = lambda: limit is None or seconds[width] <= limit * least  # noqa: E731
    best = (list(counts), expected / seconds[0] if within() else 0.0)
    for v, r, i in pool:
        if i != counts[r]:
            continue  # each row keeps a prefix of its own order
        counts[r] += 1
        if counts[r] > width:
            width = counts[r]
            seconds.append(draft_seconds + verify_seconds(width + 1, rows))
        expected += v
        was_least = row_expected[r] == least
        row_expected[r] += v
        if was_least:
            least = min(row_expected)
        rate = expected / seconds[width]
        if rate > best[1] and within():
            best = (list(counts), rate)
    return best


@dataclass
class TreeInputs:
    """What one tree verify forward needs, for every row padded to the widest tree (numpy arrays): row i's slot j
    holds token ids[i, j] at position (the row's next position) + depths[i, j] and attends to the committed context
    and to the slots allowed[i, j]; real[i, j] is False for padding. paths[i][j]: the tokens from the root to slot j,
    the history its target token follows (a padding slot is a copy of the root, and its path the root's)."""

    ids: np.ndarray  # (rows, width) int64
    depths: np.ndarray  # (rows, width) int64
    allowed: np.ndarray  # (rows, width, width) bool
    real: np.ndarray  # (rows, width) bool
    paths: list[list[list[int]]]  # (rows, width, depth + 1)

    @classmethod
    def of(cls, trees: Sequence[Tree]) -> "TreeInputs":
        rows, width = len(trees), max(len(t.tokens) for t in trees)
        ids = np.zeros((rows, width), dtype=np.int64)
        depths = np.zeros((rows, width), dtype=np.int64)
        allowed = np.zeros((rows, width, width), dtype=bool)
        real = np.zeros((rows, width), dtype=bool)
        idx = np.arange(width)
        allowed[:, idx, idx] = True  # every slot sees itself (padding sees nothing else)
        for r, t in enumerate(trees):
            n = len(t.tokens)
            ids[r, :n], ids[r, n:] = t.tokens, t.tokens[0]
            depths[r, :n] = t.depths
            real[r, :n] = True
            for i in range(1, n):  # parents come first: a node sees what its parent sees, and itself
                allowed[r, i, :i] |= allowed[r, t.parents[i], :i]
        # every slot gets a path, padding too: a sampler processes all `width` positions of every row
        paths = [t.paths() + [t.tokens[:1]] * (width - len(t.tokens)) for t in trees]
        return cls(ids, depths, allowed, real, paths)

    @property
    def width(self) -> int:
        return self.ids.shape[1]
