"""dflash/core/row.py: everything the core keeps per row travels with the row, so joining, retiring and reordering
rows is one operation (Engine.admit, Engine.retire) and a lone sequence is a batch of one."""

from dflash.core.engine import Engine
from dflash.core.sampling import SamplingParams

from fakes import FakeDrafter, FakeTarget


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
