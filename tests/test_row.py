"""dflash/core/row.py: everything the core keeps per row travels with the row, so joining, retiring and reordering
rows is one operation (Engine.admit, Engine.retire) and a lone sequence is a batch of one; the features pending for
the drafter: parts joined once equal the joins after every part, rows that kept fewer positions are packed to the
left, and adding a part joins nothing."""

import numpy as np

from dflash.core.contract import Pending
from dflash.core.engine import Engine
from dflash.core.row import PendingFeatures
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
