"""The features pending for the drafter (dflash/core/pending.py): parts joined once equal the joins after every
part, rows that kept fewer positions are packed to the left, and adding a part joins nothing."""

import numpy as np

from dflash.core.contract import Pending
from dflash.core.pending import PendingFeatures

from fakes import Counting, FakeTarget


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
