"""dflash.core.rows: the shared cache's bookkeeping, and when a compaction pays."""

import numpy as np

from dflash.core import rows
from dflash.core.rows import RowLayout


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
