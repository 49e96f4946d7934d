"""dflash.core.rows: everything the core keeps per row travels with the row, so joining, retiring and reordering
rows is one operation (Engine.admit, Engine.retire) and a lone sequence is a batch of one; the features pending
for the drafter: parts joined once equal the joins after every part, rows that kept fewer positions are packed to
the left, and adding a part joins nothing; the shared cache's bookkeeping, and when a compaction pays."""

import numpy as np
import pytest

from dflash.core import rows
from dflash.core.contract import Pending
from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.rows import PendingFeatures, RowLayout
from dflash.core.sampling import SamplingParams

from fakes import Counting, FakeDrafter, FakeTarget


def test_a_rows_sampling_prompt_lookup_and_pause_stay_its_own_as_rows_leave_and_join():
    e = Engine(FakeTarget(), FakeDrafter(3), block_size=8)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    settings = [SamplingParams(repetition_penalty=1.0 + i / 10) for i in range(3)]
    e.prefill(prompts, settings)
    assert [row.sampling.params for row in e.batch] == settings and e.rows == [p[:] for p in prompts]
    first, second, third = e.batch
    second.pause.skip, third.pause.backoff = 3, 4
    third.copied(anchor=9, length=4)  # (its prompt lookup has indexed its tokens)
    e.retire([0])  # the first row leaves: the others move up with everything they keep
    assert e.batch[0] is second and e.batch[1] is third and [s.params for s in e.row_sampling] == settings[1:]
    assert (second.pause.skip, third.pause.backoff) == (3, 4) and len(third.copies.tokens) == 3
    e.admit([10, 11, 12], SamplingParams(repetition_penalty=2.0))  # a row joins: its own state starts afresh
    joined = e.batch[-1]
    assert e.batch[0] is second and e.batch[1] is third and (joined.pause.skip, joined.pause.backoff) == (0, 0)
    assert joined.copies.tokens == [] and joined.tokens == [10, 11, 12]
    assert e.rows == [row.tokens for row in e.batch] and e.target.rows == e.rows


def test_a_lone_sequence_is_a_batch_of_one():
    e = Engine(FakeTarget(), FakeDrafter(3), block_size=8)
    e.prefill([[1, 2, 3, 4]])
    assert len(e.batch) == 1 and e.tokens is e.batch[0].tokens and e.rows == [[1, 2, 3, 4]]
    e.prefill([[1, 2, 3, 4, 5, 6]])  # the next prompt reuses the cached prefix: a fresh row over the same tokens
    assert len(e.batch) == 1 and e.tokens == [1, 2, 3, 4, 5, 6] and e.last_reused == 4


def part(rows: list[list[int]], width: int) -> Pending:
    """Row r's real positions are rows[r] (their features: the values), padded with -1 to `width`."""
    features = np.array([r + [-1] * (width - len(r)) for r in rows], dtype=float)[..., None]
    return Pending(features, [len(r) for r in rows])


def real(pending: Pending) -> list[list[int]]:
    return [[int(x) for x in pending.features[r, :n, 0]] for r, n in enumerate(pending.counts)]


def test_parts_are_joined_once_when_taken():
    target = Counting(FakeTarget())
    queue = PendingFeatures()
    parts = [part([[1, 2, 3], [4]], 3), part([[5], [6]], 1), part([[7, 8], [9]], 2), part([[10], [11]], 1)]
    for p in parts:
        queue.add(p)
    assert not target.calls and queue.counts == [7, 4]  # (added, not joined)
    joined = queue.take(target)
    assert real(joined) == [[1, 2, 3, 5, 7, 8, 10], [4, 6, 9, 11]]
    assert target.calls == {"cat": 1, "gather": 1} and not queue and queue.take(target) is None


def test_full_parts_need_no_gather():
    target = Counting(FakeTarget())
    queue = PendingFeatures()
    for p in [part([[1], [2]], 1), part([[3], [4]], 1), part([[5, 6], [7]], 2)]:  # (only the last is ragged)
        queue.add(p)
    assert real(queue.peek(target)) == [[1, 3, 5, 6], [2, 4, 7]] and target.calls == {"cat": 1}
    assert real(queue.take(target)) == [[1, 3, 5, 6], [2, 4, 7]] and target.calls == {"cat": 1}


def test_a_row_with_nothing_pending():
    queue = PendingFeatures()
    for p in [part([[1, 2], []], 2), part([[3], []], 1)]:  # (a row admitted with nothing pending yet)
        queue.add(p)
    assert real(queue.take(FakeTarget())) == [[1, 2, 3], []]


def layout(lengths, decode=0):
    """Rows of the given prompt lengths (left-padded to the longest), then `decode` one-token steps."""
    lay = RowLayout(lengths[0])
    for n in lengths[1:]:
        lay.merge(n)
    for _ in range(decode):
        lay.append(1)
        lay.keep([1] * lay.rows, 1)
    return lay


def test_padding_no_gather_removes_is_left_alone():
    lay = layout([200, 10, 10, 10])  # 71% of the slots are holes, but the long row keeps the width at 200
    assert 1 - lay.valid.mean() > 0.5
    assert lay.compaction() is None


def test_holes_every_row_has_are_gathered_away():
    lay = layout([100, 60])
    for _ in range(40):  # tree forwards of 4 slots of which every row keeps the root and one node
        lay.append(4)
        lay.keep_slots([[0, 2], [0, 3]], 4)
    assert lay.width == 260
    index = lay.compaction()
    assert index is not None and index.shape == (2, 180)  # the first row's 100 + 40 x 2
    kept = [np.flatnonzero(v) for v in lay.valid]
    lay.compacted(index)
    assert lay.width == 180 and lay.valid[0].all() and lay.valid[1].sum() == 140
    assert [list(i[-len(k):]) for i, k in zip(index, kept)] == [list(k) for k in kept]  # in order, to the right


def test_small_shrinks_wait(monkeypatch):
    lay = layout([100, 100])
    lay.append(16)
    lay.keep_slots([[0, 15], [0, 1, 15]], 16)  # 13 of 116 slots removable: under a quarter
    assert lay.compaction() is None
    monkeypatch.setattr(rows, "COMPACT_SHRINK", 0.1)
    assert lay.compaction() is not None


# ---- SharedRows over every backend's buffers: each row's valid slots hold its own entries, in order ----------------

class NumpySlots:
    """SlotBuffers over one (rows, 1, slots, 1) array: the policy's reference."""

    def __init__(self, entries=None):
        self.entries = np.zeros((0, 1, 0, 1)) if entries is None else entries

    def drop_last(self, n):
        self.entries = self.entries[:, :, :self.entries.shape[2] - n]
        return True

    def pack_tail(self, start, slots, width):
        kept = self.entries[:, :, [start + s for s in slots]]
        self.entries = np.concatenate([self.entries[:, :, :start], kept], axis=2)

    def gather_slots(self, index):
        self.entries = np.take_along_axis(self.entries, index[:, None, :, None], axis=2)

    def take_rows(self, rows):
        self.entries = self.entries[rows]

    def join(self, other, pad_mine, pad_theirs):
        pad = lambda x, n: np.pad(x, ((0, 0), (0, 0), (n, 0), (0, 0)))  # noqa: E731
        self.entries = np.concatenate([pad(self.entries, pad_mine), pad(other.entries, pad_theirs)])

    def copy_row(self, row, slots, into):
        into.entries = self.entries[row:row + 1, :, slots].copy()


class NumpyBackend:
    make = NumpySlots

    @staticmethod
    def write(buffers, values):
        buffers.entries = np.concatenate([buffers.entries, values[:, None, :, None]], axis=2) \
            if buffers.entries.size else values[:, None, :, None].astype(float)

    @staticmethod
    def read(buffers):
        return buffers.entries[:, 0, :, 0]


class TorchBackend:
    @staticmethod
    def make():
        torch = pytest.importorskip("torch")
        from transformers import DynamicCache

        from dflash.backends.torch.kv_cache import RowSlots, growing
        del torch
        return RowSlots(growing(DynamicCache(), None))

    @staticmethod
    def write(buffers, values):
        import torch
        kv = torch.tensor(values, dtype=torch.float32)[:, None, :, None]
        buffers.cache.update(kv, -kv, 0)

    @staticmethod
    def read(buffers):
        layer = buffers.cache.layers[0]
        assert (layer.values == -layer.keys).all()  # keys and values moved together
        return layer.keys[:, 0, :, 0].numpy()


class MLXBackend:
    @staticmethod
    def make():
        pytest.importorskip("mlx.core")
        from mlx_lm.models.cache import KVCache

        from dflash.backends.mlx.row_slots import RowSlots
        return RowSlots([KVCache()])

    @staticmethod
    def write(buffers, values):
        import mlx.core as mx
        kv = mx.array(values.astype(np.float32))[:, None, :, None]
        buffers.cache[0].update_and_fetch(kv, -kv)

    @staticmethod
    def read(buffers):
        c = buffers.cache[0]
        keys, values = (np.array(x[..., :c.offset, :]) for x in (c.keys, c.values))
        assert (values == -keys).all()
        return keys[:, 0, :, 0]


@pytest.mark.parametrize("backend", [NumpyBackend, TorchBackend, MLXBackend], ids=["numpy", "torch", "mlx"])
def test_shared_rows_keep_every_rows_entries_through_joins_leaves_keeps_and_compactions(backend):
    """A random run of every row operation; after each, row i's valid slots hold exactly the entries it kept, in
    order, whatever the backend's buffers did (pads, shifts, spare rows, gathers)."""
    rng = np.random.default_rng(0)
    counter = iter(range(1, 10 ** 6))
    fresh = lambda n: np.array([next(counter) for _ in range(n)], dtype=float)  # noqa: E731

    def prefilled(n):
        buffers, entries = backend.make(), fresh(n)
        backend.write(buffers, entries[None])
        return buffers, list(entries)

    first, kept = prefilled(30)
    shared, want = rows.SharedRows(first, 30), [kept]
    compactions = 0
    for step in range(120):
        op = rng.choice(["join", "leave", "chain", "tree", "extract"], p=[0.12, 0.08, 0.45, 0.3, 0.05])
        if op == "join" and shared.rows < 6:
            buffers, kept = prefilled(int(rng.integers(1, 90)))
            shared.join(buffers, len(kept))
            want.append(kept)
        elif op == "leave" and shared.rows > 1:
            stay = sorted(rng.choice(shared.rows, size=shared.rows - 1, replace=False).tolist())
            shared.select(stay)
            want = [want[i] for i in stay]
        elif op in ("chain", "tree"):
            t = int(rng.integers(1, 9))
            new = np.stack([fresh(t) for _ in range(shared.rows)])
            width = shared.layout.width
            shared.append(t)
            backend.write(shared.buffers, new)
            if op == "chain":
                keeps = rng.integers(1, t + 1, size=shared.rows).tolist()
                shared.keep(keeps, t)
                want = [w + list(n[:k]) for w, n, k in zip(want, new, keeps)]
            else:
                paths = [[0] + sorted(rng.choice(np.arange(1, t), size=int(rng.integers(0, t)), replace=False)
                                      .tolist()) if t > 1 else [0] for _ in range(shared.rows)]
                shared.keep_slots(paths, t)
                want = [w + list(n[p]) for w, n, p in zip(want, new, paths)]
            compactions += shared.layout.width < width
        elif op == "extract":
            i = int(rng.integers(shared.rows))
            alone = rows.SharedRows(backend.make())
            shared.extract(i, alone)
            assert alone.lone and alone.width == len(want[i])
            assert backend.read(alone.buffers).tolist() == [want[i]]
        entries = backend.read(shared.buffers)
        assert entries.shape[0] == shared.rows == len(want)
        for i in range(shared.rows):
            assert entries[i, shared.layout.slots_of(i)].tolist() == want[i], (step, op, i)
            assert shared.layout.positions[i] == len(want[i])
    assert compactions > 0


def test_a_join_the_buffers_refuse_leaves_the_layout_as_it_was():
    shared = rows.SharedRows(NumpySlots(np.ones((1, 1, 5, 1))), 5)

    class Refusing(NumpySlots):
        def join(self, other, pad_mine, pad_theirs):
            raise MemoryError("no room")

    shared.buffers = Refusing(shared.buffers.entries)
    with pytest.raises(MemoryError):
        shared.join(NumpySlots(np.ones((1, 1, 9, 1))), 9)
    assert shared.rows == 1 and shared.layout.width == 5


def test_a_lone_row_rewinds_from_its_end_and_a_batch_refuses_to():
    """A lone row is a SharedRows of one: a kept tree path moves to the front of its forward's slots (no holes, so
    its next forward runs at the cache's own positions), a rewind drops slots from the end, and a cache that cannot
    go back that far (a sliding window past the last forward) leaves the layout as it was."""
    lone = rows.SharedRows(NumpySlots(np.arange(5.0)[None, None, :, None]), 5)
    lone.append(4)
    lone.buffers.entries = np.arange(9.0)[None, None, :, None]
    lone.keep_slots([[0, 2, 3]], 4)  # slots 5, 7, 8 of the forward
    assert lone.lone and lone.width == 8 and lone.buffers.entries[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    assert lone.trim(3) and lone.width == 5 and lone.buffers.entries.shape[2] == 5

    class Windowed(NumpySlots):
        def drop_last(self, n):
            return False

    lone.buffers = Windowed(lone.buffers.entries)
    assert not lone.trim(2) and lone.width == 5

    batch = rows.SharedRows(NumpySlots(np.ones((1, 1, 5, 1))), 5)
    batch.join(NumpySlots(np.ones((1, 1, 3, 1))), 3)
    with pytest.raises(DFlashError, match="retire rows instead"):
        batch.trim(1)
    batch.select([0])  # (the longer row alone: no holes left, so it is a lone row again)
    assert batch.lone and batch.trim(1)
