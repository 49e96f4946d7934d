"""The drafter's context, framework-neutral: which keys a block slot sees, and where each entry sits in the cache.

Draft attention (every backend, the batched path and training): the block for anchor position a occupies
positions a .. a+B-1 and follows the context positions 0 .. a-1 (the target features of the committed tokens).
`draft_visible` is THE rule; it works on numpy, torch and mlx arrays alike (only comparisons and `&`).

The cache is position-indexed: slot s holds absolute position `offset + s`, rows of a batch share the offset and
each has its own length. Rewinding moves a length; growing doubles the buffer; with a draft window W only the last
W context entries are needed, so when the buffer fills they move to the front (offset grows). `ContextLayout` keeps
that bookkeeping; backends own the buffers and do what it says (shift, grow, write at a slot, read a span).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def draft_visible(q, k, anchor, block: int, *, window: int | None = None, sliding: int | None = None,
                  causal: bool = False):
    """Boolean mask: the block slot at absolute position q sees the key at absolute position k.

    q, k and anchor broadcast against each other (e.g. q (.., B, 1), k (.., 1, K), anchor (.., 1, 1) per row).
    Context keys (k < anchor) are visible within the draft window W (the last W before the anchor); block keys
    (anchor <= k < anchor + B) are visible to every slot, or to the slot itself and earlier ones when the layer is
    causal. A sliding layer of window S also needs |q - k| < S (z-lab's reference rule: each slot's own window)."""
    d = q - k
    visible = (k >= 0) & (k < anchor + block) & (d < (1 << 30))
    if window is not None:
        visible = visible & (k >= anchor - window)
    if causal:
        visible = visible & (d >= 0)
    if sliding is not None:
        visible = visible & (d < sliding)
        if not causal:
            visible = visible & (d > -sliding)
    return visible


@dataclass(frozen=True)
class LayerRule:
    """How one draft layer attends: its sliding window (None = full) and whether the block is causal."""

    sliding: int | None
    causal: bool

    @property
    def needs_mask(self) -> bool:  # a full, non-causal layer sees its whole span: no mask, the fast SDPA path
        return self.sliding is not None or self.causal


def layer_rules(spec) -> list[LayerRule]:
    return [LayerRule(spec.window_for_layer(i), spec.causal_for_layer(i)) for i in range(spec.num_hidden_layers)]


@dataclass
class ContextLayout:
    """Slot bookkeeping of a position-indexed draft-context cache with one or more rows."""

    capacity: int
    window: int | None = None
    lengths: list[int] = field(default_factory=lambda: [0])  # context entries per row = its anchor's position
    offset: int = 0  # absolute position of slot 0 (> 0 once a window moved entries to the front)

    @property
    def position(self) -> int:
        """Absolute position of row 0's next context entry (the single-sequence view)."""
        return self.lengths[0]

    def slot(self, position: int) -> int:
        return position - self.offset

    def plan_reserve(self, n: int) -> tuple[int, int]:
        """Room for n more entries after the longest row: returns (shift, capacity). Shift > 0 moves slot `shift..`
        to the front (a window dropped what no row still sees); a capacity above the current one means grow to it."""
        shift = 0
        end = self.slot(max(self.lengths))
        if self.window is not None and end + n > self.capacity:
            shift = max(0, self.slot(min(self.lengths) - self.window))
        if end - shift + n > self.capacity:
            return shift, max(end - shift + n, 2 * self.capacity)
        return shift, self.capacity

    def apply_reserve(self, shift: int, capacity: int) -> None:
        self.offset += shift
        self.capacity = capacity

    def span(self, rule: LayerRule, anchors: list[int], block: int) -> tuple[int, int]:
        """Slots [lo, hi) a layer reads for one draft forward of every row, row i's block written at anchors[i]:
        what lies before the draft window or a sliding layer's reach of every row is not read at all."""
        lo = 0
        if self.window is not None:
            lo = min(anchors) - self.window
        if rule.sliding is not None:
            lo = max(lo, min(anchors) - (rule.sliding - 1))
        return max(self.slot(lo), 0), self.slot(max(anchors) + block)

    def crop(self, row: int, position: int) -> bool:
        """Forget row's context from `position` on; False if a window already dropped entries it would need."""
        if position >= self.lengths[row]:
            return True
        if position < self.offset:
            return False
        self.lengths[row] = position
        return True

    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1


class ContextCache:
    """What every backend's draft-context cache shares: the slot bookkeeping. Subclasses own the K/V buffers and
    implement reserve (shift / grow them as the layout plans) and write (store entries, return a layer's span)."""

    layout: ContextLayout

    @property
    def position(self) -> int:
        return self.layout.position

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def lengths(self) -> list[int]:
        return self.layout.lengths

    def advance(self, counts: list[int]) -> None:
        self.layout.lengths = [n + c for n, c in zip(self.layout.lengths, counts)]

    def crop(self, position: int) -> bool:
        return self.layout.crop(0, position)

    def reset(self) -> None:
        self.layout.lengths, self.layout.offset = [0], 0
