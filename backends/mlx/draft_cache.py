"""The drafter's context K/V on MLX: the position-indexed design of backends/torch/draft_cache.py, laid out by
dflash.core.draft_context.ContextLayout, with per-layer buffers (rows, kv_heads, capacity, head_dim); rows of a batch
each write at their own length."""

from __future__ import annotations

import mlx.core as mx

from dflash.core.draft_context import ContextCache, ContextLayout, draft_visible, layer_rules
from dflash.core.errors import DFlashError


class DraftContextCache(ContextCache):
    def __init__(self, spec, dtype, capacity: int = 512, window: int | None = None):
        self.spec, self.window, self.dtype = spec, window, dtype
        self.rules = layer_rules(spec)
        self.layout = ContextLayout(capacity, window)
        shape = (1, spec.num_key_value_heads, capacity, spec.head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(spec.num_hidden_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(spec.num_hidden_layers)]

    def reserve(self, n: int) -> None:
        shift, capacity = self.layout.plan_reserve(n)
        if shift or capacity > self.k[0].shape[2]:
            used = self.layout.slot(max(self.layout.lengths))
            for buf in (self.k, self.v):
                for i, a in enumerate(buf):
                    buf[i] = _fit(a[:, :, shift:used], capacity)
        self.layout.apply_reserve(shift, capacity)

    def write(self, layer: int, k: mx.array, v: mx.array, counts: list[int], block: int):
        """Store each row's new entries (k, v: rows, heads, m + block, dim; the first counts[i] of the m context
        entries are real, then the block) at the row's length; return the span this layer attends to and its
        boolean mask (None: every slot of the span, for every block slot)."""
        layout, rule = self.layout, self.rules[layer]
        m = k.shape[2] - block
        uniform = layout.uniform() and all(c == m for c in counts)
        if uniform:
            at = layout.slot(layout.lengths[0])
            self.k[layer][:, :, at:at + k.shape[2]] = k
            self.v[layer][:, :, at:at + k.shape[2]] = v
        else:  # rows at different lengths: each row's block right after its real entries
            for row, (n, c) in enumerate(zip(layout.lengths, counts)):
                at = layout.slot(n)
                self.k[layer][row:row + 1, :, at:at + m] = k[row:row + 1, :, :m]
                self.v[layer][row:row + 1, :, at:at + m] = v[row:row + 1, :, :m]
                self.k[layer][row:row + 1, :, at + c:at + c + block] = k[row:row + 1, :, m:]
                self.v[layer][row:row + 1, :, at + c:at + c + block] = v[row:row + 1, :, m:]
        anchors = [n + c for n, c in zip(layout.lengths, counts)]
        lo, hi = layout.span(rule, anchors, block)
        mask = None
        if block and (rule.needs_mask or not uniform):
            anchor = mx.array([layout.slot(a) - lo for a in anchors])[:, None, None, None]
            q = anchor + mx.arange(block)[:, None]
            mask = draft_visible(q, mx.arange(hi - lo)[None], anchor, block, window=self.window,
                                 sliding=rule.sliding, causal=rule.causal)
        return self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi], mask

    def state(self) -> list[mx.array]:
        return self.k + self.v

    def reset(self) -> None:
        super().reset()
        self.k, self.v = [a[:1] for a in self.k], [a[:1] for a in self.v]  # one row again

    def select(self, rows: list[int]) -> None:
        idx = mx.array(rows, dtype=mx.int32)
        self.k, self.v = [a[idx] for a in self.k], [a[idx] for a in self.v]
        self.layout.lengths = [self.layout.lengths[i] for i in rows]

    def merge(self, other: "DraftContextCache") -> None:
        """Append other's rows (a row prefilled alone) to this batch."""
        if other.layout.offset != self.layout.offset:
            raise DFlashError("--draft-window: a windowed draft context cannot join a batch; drop --draft-window")
        size = max(self.layout.capacity, other.layout.capacity)
        self.k = [mx.concatenate([_fit(a, size), _fit(b, size)]) for a, b in zip(self.k, other.k)]
        self.v = [mx.concatenate([_fit(a, size), _fit(b, size)]) for a, b in zip(self.v, other.v)]
        self.layout.capacity = size
        self.layout.lengths = self.layout.lengths + other.layout.lengths

    def extract(self, row: int) -> "DraftContextCache":
        """Row's context alone, in a cache of its own."""
        if self.window is not None:
            raise DFlashError("prefix cache: a windowed draft context is not kept across requests")
        out = self.subset([row])
        mx.eval(out.k, out.v)  # copies now: unevaluated, they would pin the whole batch's buffers
        return out

    def subset(self, rows: list[int], room: int = 0) -> "DraftContextCache":
        """These rows, in a cache of their own sized to what they hold and `room` more entries (a draft forward of
        some rows writes its blocks there; the batch's buffers stay as they are)."""
        out = DraftContextCache(self.spec, self.dtype, capacity=1, window=self.window)
        used = max(self.layout.slot(max(self.layout.lengths[r] for r in rows)), 1)
        idx = mx.array(rows, dtype=mx.int32)
        out.k, out.v = ([_fit(mx.take(a[:, :, :used], idx, axis=0), used + room) for a in buf]
                        for buf in (self.k, self.v))
        out.layout.capacity, out.layout.offset = used + room, self.layout.offset
        out.layout.lengths = [self.layout.lengths[r] for r in rows]
        return out

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def _fit(a: mx.array, capacity: int) -> mx.array:
    """a (rows, heads, slots, dim) cut or zero-padded to `capacity` slots."""
    if a.shape[2] >= capacity:
        return a[:, :, :capacity]
    return mx.pad(a, [(0, 0), (0, 0), (0, capacity - a.shape[2]), (0, 0)])
