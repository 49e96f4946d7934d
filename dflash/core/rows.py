"""The batch's rows, framework-neutral: what the core keeps per row (`Row`, `PendingFeatures`), and the rows' layout
in the one target KV cache they share (`SharedRows`, `SlotBuffers`).

A batch is a list of Rows in the caches' row order, so joining, retiring and reordering rows is one list operation on
the engine (admit, retire), and a lone sequence is a batch of one. What lives in the backend's arrays per row (K/V
slots, the drafter's context, the target features the drafter has not read yet) is moved by the same operation
through the backend's primitives (Target.select / merge, Drafter.select / merge, PendingFeatures.select / add_row).
The pending features are kept as the cycles committed them and joined once, when a draft (or an absorb) takes them:
a cycle without a draft forward (a plain step, or copied nodes alone) appends its part (a view of the verify forward's
features), and the join is one concatenation, plus one gather where rows kept different numbers of positions
(joining after every such cycle would copy everything pending every cycle, work a plain decoder does not do).

`SharedRows` owns the cache's rows: which slots each row may attend to, the position its next token takes, and a
backend's K/V buffers (`SlotBuffers`), changed together, so every row operation (join, leave, keep, rewind,
compaction, extraction) is written once, here, and a backend only moves K/V entries where it is told. A lone row is a
SharedRows of one: while it has no holes (`lone`), its positions are the cache's own, so the backend runs its plain
forward (no explicit positions, no mask) and a cycle's rejected slots are dropped from the cache's end (which a
sliding window or a recurrent state may refuse: `trim`).

Every forward appends the same number of slots to every row. A cycle keeps its block's first max(keep) slots for
every row and marks the slots a row did not accept as holes, like the left padding of a row that joined with a
shorter prompt; each row's tokens carry their true positions (explicit RoPE positions), so its attention sees what
batch-1 decoding sees. When gathering every row's valid slots to the right would shrink the cache by a quarter, they
are gathered (compaction). Holes that no gather removes (a short row's padding beside the longest row) are left alone:
a gather that keeps the width costs a copy of the whole cache and saves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from .budget import Pause
from .contract import Pending
from .errors import DFlashError
from .sampling import RowSampling
from .tree import CopyIndex

if TYPE_CHECKING:
    from typing import Self  # (3.11)

    from .contract import Target
    from .tree import TreeInputs

COMPACT_MIN_SLOTS = 64  # below this a compaction costs more than the holes it removes
COMPACT_SHRINK = 0.25  # compact once that removes this fraction of the cache's slots


@dataclass
class Row:
    tokens: list[int]  # ids whose K/V is in the target cache
    sampling: RowSampling  # its settings, acceptance rule, noise seed and proposal-shape chooser
    copies: CopyIndex = field(default_factory=CopyIndex)  # prompt lookup over its tokens (the copied branch)
    pause: Pause = field(default_factory=Pause)  # auto: its own pause from the draft forward

    def copied(self, anchor: int, length: int) -> list[int]:
        """Its branch copied from its context (prompt lookup), brought up to `anchor`: at most `length` tokens."""
        self.copies.update(self.tokens + [anchor])
        return self.copies.continuation(length)


class PendingFeatures:
    """Parts (rows, w, K*H) in commit order; row i's first counts[i] positions of each part are real."""

    def __init__(self) -> None:
        self.parts: list[Pending] = []
        self.counts: list[int] = []  # per row, over every part

    def __bool__(self) -> bool:
        return bool(self.parts)

    def add(self, part: Pending) -> None:
        self.parts.append(part)
        self.counts = list(part.counts) if len(self.parts) == 1 else [a + b for a, b in
                                                                      zip(self.counts, part.counts)]

    def set(self, pending: Pending | None) -> None:
        """Replace everything pending with `pending` (None: nothing)."""
        self.parts, self.counts = [], []
        if pending is not None:
            self.add(pending)

    def take(self, target: Target) -> Pending | None:
        """Everything pending as one Pending (None if nothing is), and nothing pending after."""
        joined = self.peek(target)
        self.set(None)
        return joined

    def select(self, rows: list[int], target: Target) -> None:
        """Keep these rows' pending features, in this order (rows retired or reordered)."""
        joined = self.peek(target)
        if joined is not None:
            self.set(Pending(target.take_rows(joined.features, rows), [joined.counts[i] for i in rows]))

    def add_row(self, target: Target) -> None:
        """A row joined the batch with nothing pending."""
        joined = self.peek(target)
        if joined is not None:
            self.set(Pending(target.pad_rows(joined.features, 1), joined.counts + [0]))

    def crop(self, n: int, target: Target) -> None:
        """A lone row keeps at most its first n pending positions (its cache was cropped)."""
        joined = self.peek(target)
        if joined is not None and n < joined.counts[0]:
            self.set(Pending(target.head(joined.features, n), [n]))

    def peek(self, target: Target) -> Pending | None:
        """Everything pending as one Pending; it stays pending (as that one part)."""
        if len(self.parts) > 1:
            self.set(join(self.parts, target))
        return self.parts[0] if self.parts else None


def join(parts: list[Pending], target: Target) -> Pending:
    """Parts in order as one Pending: row i's real positions of every part, packed to the left."""
    widths = [p.features.shape[1] for p in parts]
    features = target.cat([p.features for p in parts])
    counts = [sum(row) for row in zip(*(p.counts for p in parts))]
    # a row that kept fewer positions of a part than its width, before the last part: gather its real ones
    if any(c != w for p, w in zip(parts[:-1], widths) for c in p.counts):
        starts = [sum(widths[:j]) for j in range(len(parts))]
        slots = [[s + k for s, p in zip(starts, parts) for k in range(p.counts[r])] or [0]
                 for r in range(len(counts))]
        features = target.gather(features, slots)
    return Pending(features, counts)


def visible(keys, t: int, arange):
    """The attention mask (rows, t, S) of a forward of t new slots after a cache whose slot validity is `keys`
    (rows, S, the new slots included): causal over valid slots. A padding query sees itself, so no softmax row is
    empty. Works on numpy, torch and mlx arrays alike (`arange` is the framework's)."""
    total = keys.shape[1]
    q = arange(total - t, total)[:, None]
    k = arange(total)[None]
    return (keys[:, None, :] & (k <= q)) | (k == q)


class RowLayout:
    """Slot validity (rows, slots) and next positions (rows,) of a shared cache; starts as one row of `length`."""

    def __init__(self, length: int):
        self.valid = np.ones((1, length), dtype=bool)
        self.positions = np.array([length], dtype=np.int64)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    @property
    def lone(self) -> bool:
        """One row without holes: its positions are its slots (every valid slot holds one of its positions)."""
        return self.rows == 1 and int(self.positions[0]) == self.width

    # ---- forwards --------------------------------------------------------------------------------------------------
    def append(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """t new slots for every row: their positions (rows, t) and the keys' validity (rows, S + t) the mask needs."""
        positions = self.positions[:, None] + np.arange(t)
        self.valid = np.concatenate([self.valid, np.ones((self.rows, t), dtype=bool)], axis=1)
        self.positions = self.positions + t
        return positions, self.valid

    def append_tree(self, depths: np.ndarray, allowed: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A tree forward (dflash.core.tree.TreeInputs): slot j of row i at its next position + depth, seeing the
        row's valid context and its ancestors. Returns (positions (rows, t), mask (rows, t, S + t))."""
        t = depths.shape[1]
        positions = self.positions[:, None] + depths
        context = np.broadcast_to(self.valid[:, None, :], (self.rows, t, self.width))
        mask = np.concatenate([context, allowed], axis=2)
        self.valid = np.concatenate([self.valid, real], axis=1)
        self.positions = self.positions + t
        return positions, mask

    # ---- what a cycle keeps ------------------------------------------------------------------------------------------
    def keep(self, keeps: list[int], width: int) -> int:
        """After a forward of `width` slots, row i keeps its first keeps[i]; returns how many trailing slots the
        backend drops from its buffers (the slots no row kept)."""
        most = max(keeps)
        kept = np.arange(most)[None] < np.asarray(keeps)[:, None]
        return self._keep(kept, width)

    def keep_slots(self, slots: list[list[int]], width: int) -> int:
        """After a tree forward of `width` slots, row i keeps slots[i] (the root and its accepted path) where they
        are; their RoPE positions are already the path's (root at the row's position, depth d at position + d)."""
        most = max(max(s) + 1 for s in slots)
        kept = np.zeros((len(slots), most), dtype=bool)
        for i, s in enumerate(slots):
            kept[i, s] = True
        return self._keep(kept, width)

    def _keep(self, kept: np.ndarray, width: int) -> int:
        drop = width - kept.shape[1]
        self.valid = self.valid[:, :self.width - drop].copy()
        self.valid[:, self.width - kept.shape[1]:] = kept
        self.positions = self.positions - width + kept.sum(1)
        return drop

    def drop(self, n: int) -> None:
        """Forget every row's last n slots (a lone row's last n positions)."""
        self.valid = self.valid[:, :self.width - n]
        self.positions = self.positions - n

    def compaction(self) -> np.ndarray | None:
        """When it removes COMPACT_SHRINK of a large cache's slots: per row, the slots (rows, W) that gather its valid
        ones, in order, to the right end of a buffer of width W (the most valid slots of any row); the backend gathers,
        then calls `compacted`. None: not worth it."""
        if self.width <= COMPACT_MIN_SLOTS:
            return None
        width = int(self.valid.sum(1).max())
        if self.width - width < COMPACT_SHRINK * self.width:
            return None
        order = np.argsort(self.valid.astype(np.int8), axis=1, kind="stable")  # invalid first, both in slot order
        return order[:, self.width - width:]

    def compacted(self, index: np.ndarray) -> None:
        self.valid = np.take_along_axis(self.valid, index, axis=1)

    # ---- rows --------------------------------------------------------------------------------------------------------
    def padding(self, length: int) -> tuple[int, int]:
        """The left padding (mine, its) that aligns a row of `length` slots and this layout to one width."""
        width = max(self.width, length)
        return width - self.width, width - length

    def merge(self, length: int) -> tuple[int, int]:
        """Append a row of `length` valid slots; returns the left padding (mine, its) that aligns both to one width."""
        mine, theirs = self.padding(length)
        self.valid = np.concatenate([np.pad(self.valid, ((0, 0), (mine, 0))),
                                     np.pad(np.ones((1, length), dtype=bool), ((0, 0), (theirs, 0)))])
        self.positions = np.append(self.positions, length)
        return mine, theirs

    def select(self, rows: list[int]) -> None:
        self.valid, self.positions = self.valid[rows], self.positions[rows]

    def slots_of(self, row: int) -> np.ndarray:
        """Row's valid slots, in order (its cache alone, when it leaves the batch with its prefix kept)."""
        return np.flatnonzero(self.valid[row])


class SlotBuffers(Protocol):
    """A backend's K/V for rows sharing slots: every layer's (rows, heads, slots, head_dim) entries, which the target's
    forwards append to. The buffers hold no layout: SharedRows tells them what to move."""

    def drop_last(self, n: int) -> bool: ...                   # forget the last n slots of every row (False: cannot)
    def pack_tail(self, start: int, slots: list[int], width: int) -> None: ...  # one row: keep slots of the last
    # `width` (from `start`), moved to their front, and drop the rest
    def gather_slots(self, index: np.ndarray) -> None: ...     # row i keeps its slots index[i] (rows, W), in order
    def take_rows(self, rows: list[int]) -> None: ...          # keep these rows, in this order
    def join(self, other: Self, pad_mine: int, pad_theirs: int) -> None: ...  # append other's rows, both left-padded
    def copy_row(self, row: int, slots: np.ndarray, into: Self) -> None: ...  # row's slots into empty buffers


B = TypeVar("B", bound=SlotBuffers)


class SharedRows(Generic[B]):
    """Rows sharing one target cache: its layout and its buffers (those of one row of `length` positions at first)."""

    def __init__(self, buffers: B, length: int = 0):
        self.buffers, self.layout = buffers, RowLayout(length)

    @property
    def rows(self) -> int:
        return self.layout.rows

    @property
    def width(self) -> int:
        """Slots per row (a lone row: its positions)."""
        return self.layout.width

    @property
    def lone(self) -> bool:
        """One row without holes: the backend's forwards take the cache's own positions (grow after each)."""
        return self.layout.lone

    def grow(self, t: int) -> None:
        """A lone row's forward of t tokens at the cache's own positions."""
        self.layout.append(t)

    def append(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """A forward of t slots per row: their positions (rows, t) and the attention mask (rows, t, S + t)."""
        positions, keys = self.layout.append(t)
        return positions, visible(keys, t, np.arange)

    def append_tree(self, tree: TreeInputs) -> tuple[np.ndarray, np.ndarray]:
        return self.layout.append_tree(tree.depths, tree.allowed, tree.real)

    def keep(self, keeps: list[int], width: int) -> bool:
        """After a forward of `width` slots, row i keeps its first keeps[i]; False if a lone row's cache cannot go
        back that far."""
        if self.lone:
            return self.trim(width - keeps[0])
        self._drop(self.layout.keep(keeps, width))
        return True

    def keep_slots(self, slots: list[list[int]], width: int) -> None:
        """After a tree forward of `width` slots, row i keeps slots[i]: a lone row moves them to the front of the
        forward's slots (it keeps no holes), rows of a batch keep them where they are (the rest become holes)."""
        if self.lone:
            self.buffers.pack_tail(self.width - width, slots[0], width)
            self.layout.drop(width - len(slots[0]))
            return
        self._drop(self.layout.keep_slots(slots, width))

    def trim(self, n: int) -> bool:
        """Forget a lone row's last n positions; False if its cache cannot (a window or a recurrent state that went
        past them)."""
        if not self.lone:
            raise DFlashError("trim: rows sharing a cache are not rewound; retire rows instead")
        if n and not self.buffers.drop_last(n):
            return False
        self.layout.drop(n)
        return True

    def join(self, buffers: B, length: int) -> None:
        """Append a row of `length` positions (its buffers'), the shorter side left-padded; the layout changes only
        once the buffers took the row."""
        self.buffers.join(buffers, *self.layout.padding(length))
        self.layout.merge(length)

    def select(self, rows: list[int]) -> None:
        if rows == list(range(self.rows)):
            return  # (every row, in order: nothing moves)
        self.buffers.take_rows(rows)
        self.layout.select(rows)

    def extract(self, row: int, into: SharedRows[B]) -> None:
        """Row's valid slots, in order, into an empty SharedRows's buffers (a prefix kept after the row leaves): a
        lone row there."""
        slots = self.layout.slots_of(row)
        self.buffers.copy_row(row, slots, into.buffers)
        into.layout = RowLayout(len(slots))

    def _drop(self, n: int) -> None:
        """Forget the last n slots of every row (the layout already did), then compact if holes fill the cache."""
        if n and not self.buffers.drop_last(n):
            raise AssertionError("rows sharing a cache drop slots of their last forward")
        index = self.layout.compaction()
        if index is not None:
            self.buffers.gather_slots(index)
            self.layout.compacted(index)
