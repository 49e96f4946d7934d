"""The drafter's context K/V on torch: position-indexed buffers laid out by dflash.core.draft_context.ContextLayout.

Buffers are (layers, rows, kv_heads, capacity, head_dim); slot s holds absolute position layout.offset + s. A draft
forward writes each row's new context entries and its block at the row's own length, reads the span the layer
needs, and forgets the block by not advancing. `DraftContextCache` grows by doubling (and recycles slots under a
draft window); `StaticDraftCache` has a fixed capacity and fixed addresses for compiled, CUDA-graph-captured drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.core.draft_context import ContextCache, ContextLayout, draft_visible, layer_rules
from dflash.core.errors import DFlashError


class DraftContextCache(ContextCache):
    def __init__(self, spec, dtype: torch.dtype, device, capacity: int = 512, window: int | None = None):
        self.spec, self.window = spec, window
        self.rules = layer_rules(spec)
        self.layout = ContextLayout(capacity, window)
        shape = (spec.num_hidden_layers, 1, spec.num_key_value_heads, capacity, spec.head_dim)
        # the buffers hold room for more rows than the batch has (grown by doubling), so that a joining row is one
        # row's copy and a leaving one moves only the rows after it; k and v are the live rows' views
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        self._masks: dict[tuple, torch.Tensor] = {}

    @classmethod
    def holding(cls, spec, k: torch.Tensor, v: torch.Tensor, lengths: list[int], offset: int = 0,
                window: int | None = None) -> DraftContextCache:
        """A cache over these buffers (layers, rows, kv_heads, capacity, head_dim), its rows `lengths` long after
        `offset` dropped positions."""
        cache = cls(spec, k.dtype, k.device, capacity=k.shape[3], window=window)
        cache._k, cache._v = k, v
        cache.layout.offset, cache.layout.lengths = offset, list(lengths)
        return cache

    @property
    def allocated_rows(self) -> int:
        """Rows the buffers hold room for: the live ones and the spare ones a joining row is copied into."""
        return self._k.shape[1]

    @property
    def k(self) -> torch.Tensor:
        return self._k[:, :len(self.layout.lengths)]

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, :len(self.layout.lengths)]

    def reserve(self, n: int) -> None:
        shift, capacity = self.layout.plan_reserve(n)
        if shift:
            used = self.layout.slot(max(self.layout.lengths))
            self.k[:, :, :, :used - shift] = self.k[:, :, :, shift:used].clone()
            self.v[:, :, :, :used - shift] = self.v[:, :, :, shift:used].clone()
        if capacity > self._k.shape[3]:
            pad = capacity - self._k.shape[3]
            self._k, self._v = F.pad(self._k, (0, 0, 0, pad)), F.pad(self._v, (0, 0, 0, pad))
        self.layout.apply_reserve(shift, capacity)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int], block: int):
        """Store each row's new entries (k, v: rows, heads, m + block, dim; the first counts[i] of the m context
        entries are real, then the block) at the row's length; return the span this layer attends to and its mask
        (None: every slot of the span, for every block slot)."""
        layout, rule = self.layout, self.rules[layer]
        m = k.shape[2] - block
        if layout.uniform() and len(set(counts)) == 1 and counts[0] == m:
            at = layout.slot(layout.lengths[0])
            self.k[layer, :, :, at:at + k.shape[2]] = k
            self.v[layer, :, :, at:at + k.shape[2]] = v
        else:  # rows at different lengths: scatter, the block right after each row's real entries
            self._scatter(layer, k[:, :, :m], v[:, :, :m], [layout.slot(n) for n in layout.lengths])
            self._scatter(layer, k[:, :, m:], v[:, :, m:],
                          [layout.slot(n + c) for n, c in zip(layout.lengths, counts)])
        lo, hi = layout.span(rule, [n + c for n, c in zip(layout.lengths, counts)], block)
        mask = None
        if block and (rule.needs_mask or not layout.uniform() or len(set(counts)) > 1):
            mask = self._mask(layer, lo, hi, counts, block)
        return self.k[layer, :, :, lo:hi], self.v[layer, :, :, lo:hi], mask

    def _scatter(self, layer, k, v, starts: list[int]) -> None:
        if k.shape[2] == 0:
            return
        at = torch.tensor(starts, device=k.device)[:, None] + torch.arange(k.shape[2], device=k.device)
        index = at[:, None, :, None].expand_as(k)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)

    def _mask(self, layer: int, lo: int, hi: int, counts: list[int], block: int) -> torch.Tensor:
        rule, layout = self.rules[layer], self.layout
        # positions relative to the span's first slot: the mask depends only on these, so it is reused across cycles
        anchors = tuple(layout.slot(n + c) - lo for n, c in zip(layout.lengths, counts))
        key = (hi - lo, anchors, block, rule)
        mask = self._masks.get(key)
        if mask is None:
            device = self.k.device
            anchor = torch.tensor(anchors, device=device)[:, None, None, None]
            q = anchor + torch.arange(block, device=device)[:, None]
            k = torch.arange(hi - lo, device=device)
            mask = draft_visible(q, k, anchor, block, window=self.window, sliding=rule.sliding, causal=rule.causal)
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[key] = mask
        return mask

    def reset(self) -> None:
        super().reset()
        self._k, self._v = self._k[:, :1], self._v[:, :1]  # one row again (a batch may have been merged in)

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order: rows before the first change stay where they are, and of the others only
        the slots some row holds move (not the buffer's spare capacity)."""
        first = next((i for i, r in enumerate(rows) if r != i), len(rows))
        if first < len(rows):
            idx = torch.tensor(rows[first:], device=self._k.device)
            used = self.layout.slot(max(self.layout.lengths[r] for r in rows))
            self._k[:, first:len(rows), :, :used] = self._k[:, idx, :, :used]
            self._v[:, first:len(rows), :, :used] = self._v[:, idx, :, :used]
        self.layout.lengths = [self.layout.lengths[i] for i in rows]

    def extract(self, i: int) -> DraftContextCache:
        """Row i alone, in buffers of its own sized to what it holds."""
        return self.subset([i])

    def subset(self, rows: list[int], room: int = 0) -> DraftContextCache:
        """These rows, in buffers of their own sized to what they hold and `room` more entries (a draft forward of
        some rows writes its blocks there; the batch's buffers stay as they are)."""
        used = max(self.layout.slot(max(self.layout.lengths[r] for r in rows)), 1)
        shape = (self._k.shape[0], len(rows), self._k.shape[2], used + room, self._k.shape[4])
        k, v = self._k.new_zeros(shape), self._v.new_zeros(shape)
        idx = torch.tensor(rows, device=self._k.device)
        k[:, :, :, :used], v[:, :, :, :used] = self._k[:, idx, :, :used], self._v[:, idx, :, :used]
        return DraftContextCache.holding(self.spec, k, v, [self.layout.lengths[r] for r in rows],
                                         self.layout.offset, self.window)

    @property
    def nbytes(self) -> int:
        """The buffers' bytes, spare rows included (what the cache holds on to)."""
        return self._k.nbytes + self._v.nbytes

    def merge(self, other: "DraftContextCache") -> None:
        """Append other's rows (a row prefilled alone) to this batch."""
        if other.layout.offset != self.layout.offset:
            raise DFlashError("--draft-window: a windowed draft context cannot join a batch; drop --draft-window")
        n, m, used = len(self.layout.lengths), len(other.layout.lengths), other.k.shape[3]
        size = max(self._k.shape[3], used)
        if n + m > self._k.shape[1] or size > self._k.shape[3]:  # no room: grow (rows by doubling), once
            shape = list(self._k.shape)
            if n + m > shape[1]:
                shape[1] = max(n + m, 2 * shape[1])
            shape[3] = size
            k, v = self._k.new_zeros(shape), self._v.new_zeros(shape)
            k[:, :n, :, :self._k.shape[3]] = self._k[:, :n]
            v[:, :n, :, :self._v.shape[3]] = self._v[:, :n]
            self._k, self._v = k, v
        # (slots past a row's length are never visible: what an earlier row left there stays unread)
        self._k[:, n:n + m, :, :used] = other.k
        self._v[:, n:n + m, :, :used] = other.v
        self.layout.capacity = size
        self.layout.lengths = self.layout.lengths + other.layout.lengths


class StaticDraftCache(DraftContextCache):
    """One fixed-capacity buffer (no window, no growth, one row) for the compiled fixed-shape draft forward: new
    context is padded to the block size and written at device-side offsets; attention spans the whole buffer under
    the mask of dflash.core.draft_context, so slots past the valid context (an earlier block's K/V, padding) are unseen
    until overwritten."""

    def __init__(self, spec, dtype: torch.dtype, device, capacity: int):
        super().__init__(spec, dtype, device, capacity=capacity)

    def reserve(self, n: int) -> None:
        if self.layout.position + n > self.capacity:
            raise DFlashError(f"context: {self.layout.position + n} positions exceed the static draft cache "
                              f"({self.capacity}); raise cache_len")

    def put(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (1, kv_heads, len(slots), head_dim) at `slots` of `layer`: one index_put on each whole buffer,
        every index a tensor (compiled, a write through a view of the buffers became a copy of all of it)."""
        device = slots.device
        index = (torch.tensor(layer, device=device), torch.tensor(0, device=device),
                 torch.arange(k.shape[1], device=device)[:, None], slots[None])
        self._k.index_put_(index, k[0])
        self._v.index_put_(index, v[0])

    def static_mask(self, layer: int, start: torch.Tensor, n: torch.Tensor, block: int, window: int) -> torch.Tensor:
        """The layer's mask over the first `window` slots for a block whose anchor sits at device-side position
        start + n."""
        rule = self.rules[layer]
        anchor = start + n
        q = anchor + torch.arange(block, device=self.k.device)[:, None]
        k = torch.arange(window, device=self.k.device)
        return draft_visible(q, k, anchor, block, sliding=rule.sliding, causal=rule.causal)[None, None]

    def merge(self, other) -> None:
        raise DFlashError("--batch-size: batched decoding runs on the dynamic cache; drop --compile / cache_len")


class BlockOnlyContext(ContextCache):
    """The context of an ablation drafter (dflash.core.spec context_mode none / input), whose attention sees only the
    block: no K/V, only each row's length (its anchor's position) and, for input fusion, the projected target
    feature of every context position (rewinding to any position keeps the feature before it)."""

    def __init__(self, spec, dtype: torch.dtype, device, capacity: int = 512):
        self.layout = ContextLayout(capacity)
        self.features = torch.zeros(1, capacity, spec.hidden_size, dtype=dtype, device=device) \
            if spec.context_mode == "input" else None

    def reserve(self, n: int) -> None:
        shift, capacity = self.layout.plan_reserve(n)
        if self.features is not None and capacity > self.features.shape[1]:
            self.features = F.pad(self.features, (0, 0, 0, capacity - self.features.shape[1]))
        self.layout.apply_reserve(shift, capacity)

    def write(self, projected: torch.Tensor, counts: list[int]) -> None:
        """Store each row's first counts[i] projected features (rows, m, H) after its context."""
        if self.features is None:
            return
        for row, (n, c) in enumerate(zip(self.lengths, counts)):
            self.features[row, n:n + c] = projected[row, :c]

    def reset(self) -> None:
        super().reset()
        if self.features is not None:
            self.features = self.features[:1]

    def select(self, rows: list[int]) -> None:
        if self.features is not None:
            self.features = self.features[torch.tensor(rows, device=self.features.device)]
        self.layout.lengths = [self.layout.lengths[i] for i in rows]

    def extract(self, i: int) -> BlockOnlyContext:
        """Row i alone (a prefix kept after the row leaves the batch)."""
        row = BlockOnlyContext.__new__(BlockOnlyContext)
        row.layout = ContextLayout(self.layout.capacity, lengths=[self.layout.lengths[i]])
        row.features = None if self.features is None else self.features[i:i + 1].clone()
        return row

    @property
    def nbytes(self) -> int:
        return 0 if self.features is None else self.features.nbytes

    def merge(self, other: "BlockOnlyContext") -> None:
        if self.features is not None and other.features is not None:
            size = max(self.features.shape[1], other.features.shape[1])
            fit = lambda t: F.pad(t, (0, 0, 0, size - t.shape[1]))  # noqa: E731
            self.features = torch.cat([fit(self.features), fit(other.features)])
            self.layout.capacity = size
        self.layout.lengths = self.layout.lengths + other.layout.lengths
