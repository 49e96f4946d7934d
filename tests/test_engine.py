"""The engine (dflash/core/engine.py) against pure-numpy primitives: what the caches hold after prefill, commit, crop,
admit and retire, for one row and for many. The fake target's features are the token ids themselves, so the
drafter's context can be checked against the committed tokens exactly."""

import pytest

from dflash.core.cycle import chain_cycle
from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.loop import generate, generate_batch

from fakes import FakeDrafter, FakeTarget, next_token


def reference(prompt, n):
    hist = list(prompt)
    for _ in range(n):
        hist.append(next_token(hist))
    return hist[len(prompt):]


def engine(good=3, block_size=8, chunk=2048, bounded=False):
    return Engine(FakeTarget(bounded), FakeDrafter(good), block_size=block_size, prefill_chunk=chunk)


def in_sync(e: Engine):
    """Target cache == committed tokens; drafter context + pending == every committed token but the anchor."""
    assert e.target.rows == e.rows
    for r, row in enumerate(e.rows):
        pending = e.pending.counts[r] if e.pending is not None else 0
        ctx = e.drafter.context[r] + ([int(x) for x in e.pending.features[r, :pending, 0]] if pending else [])
        assert ctx == row


@pytest.mark.parametrize("good", [0, 3, 7])
def test_one_row_commits_target_only_tokens(good):
    e = engine(good)
    r = generate(e, [1, 2, 3], max_new_tokens=30)
    assert r.tokens == reference([1, 2, 3], 30)
    assert set(r.acceptance_lengths[:-1]) == {good + 1}
    in_sync(e)


def test_chunked_prefill_and_prefix_reuse():
    e = engine(chunk=4)
    prompt = list(range(1, 12))
    generate(e, prompt, max_new_tokens=5)
    assert e.target.forwards[:3] == [4, 4, 3]  # chunks
    in_sync(e)
    follow = e.tokens + [7, 9]
    e.target.forwards.clear()
    r = generate(e, follow, max_new_tokens=6)
    assert e.target.forwards[0] == 2  # only the new turn is fed
    assert r.tokens == reference(follow, 6)
    in_sync(e)


def test_crop_keeps_caches_consistent():
    e = engine()
    generate(e, [5, 6, 7, 8], max_new_tokens=20)
    for length in (20, 9, 3):
        e.crop(length)
        assert len(e.tokens) == length
        in_sync(e)
    assert generate(e, [5, 6, 7, 8, 1], max_new_tokens=8).tokens == reference([5, 6, 7, 8, 1], 8)


def test_a_target_that_cannot_rewind_starts_over():
    e = engine(bounded=True)
    generate(e, [5, 6, 7, 8], max_new_tokens=20)
    e.target.forwards.clear()
    r = generate(e, [5, 6, 7, 9], max_new_tokens=8)  # diverges inside the prompt: older than the last forward
    assert e.target.forwards[0] == 4 and r.tokens == reference([5, 6, 7, 9], 8)  # the whole prompt again
    in_sync(e)


def test_a_bounded_target_still_rewinds_within_its_last_forward():
    """How far back a target goes is its trim's answer, not a declaration: inside its last forward even a bounded
    target rewinds, so a prompt that diverges in the last committed token prefills only that token."""
    e = engine(bounded=True)
    generate(e, [5, 6, 7, 8], max_new_tokens=20)
    cached = list(e.tokens)
    assert 1 <= e.target.last < len(cached) - 4  # the last forward kept the newest tokens only
    e.target.forwards.clear()
    prompt = cached[:-1] + [(cached[-1] + 1) % 64]
    r = generate(e, prompt, max_new_tokens=8)
    assert e.target.forwards[0] == 1 and r.tokens == reference(prompt, 8)
    in_sync(e)


def test_batch_rows_equal_their_single_outputs_and_stop_alone():
    prompts = [[1, 2], [3, 4, 5, 6, 7], [9], [11, 12, 13]]
    eos = {reference(prompts[1], 24)[9]}  # a token row 1 emits: it (and maybe others) stop early
    want = [generate(engine(), p, max_new_tokens=24, eos_token_ids=eos).tokens for p in prompts]
    e = engine()
    got = generate_batch(e, prompts, max_new_tokens=24, eos_token_ids=eos)
    assert [g.tokens for g in got] == want
    assert len({len(w) for w in want}) > 1  # rows finished at different cycles
    assert e.rows == [] and e.target.rows == []  # every row retired


def test_a_row_joins_and_leaves_a_running_batch():
    e = engine(good=2)
    e.set_sampling(e.sampling)
    firsts = e.prefill([[1, 2, 3], [4, 5]])
    outs = [[f] for f in firsts]
    prompts = [[1, 2, 3], [4, 5]]
    for cycle in range(6):
        if cycle == 2:  # a third request arrives between cycles
            prompts.append([7, 8, 9, 10])
            outs.append([e.admit(prompts[-1])])
            in_sync(e)
        if cycle == 4:  # the first finishes
            e.retire([0])
            prompts.pop(0)
            outs.pop(0)
        verified = e.verify(e.draft([o[-1] for o in outs]))
        keeps = []
        for o, d, t in zip(outs, verified.proposals, verified.tokens):
            n = next((i for i, (a, b) in enumerate(zip(d, t)) if a != b), len(d))
            o.extend(t[:n + 1])
            keeps.append(n + 1)
        e.commit(verified, keeps)
        in_sync(e)
    for p, o in zip(prompts, outs):
        assert o == reference(p, len(o))


def test_batches_are_not_cropped():
    e = engine()
    e.prefill([[1, 2], [3, 4]])
    with pytest.raises(DFlashError, match="retire rows"):
        e.crop(1)
    e.prefill([[1, 2, 3]])  # a single prompt after a batch: a fresh start
    assert e.rows == [[1, 2, 3]] and e.target.rows == [[1, 2, 3]]


def test_a_second_batch_after_the_first():
    e = engine()
    first = generate_batch(e, [[1, 2], [3, 4, 5]], max_new_tokens=12)
    second = generate_batch(e, [[6], [7, 8], [9, 10, 11]], max_new_tokens=12)
    assert [g.tokens for g in first + second] == [reference(p, 12) for p in ([1, 2], [3, 4, 5], [6], [7, 8],
                                                                              [9, 10, 11])]
    in_sync(e)


def test_a_short_chain_drafts_only_the_positions_it_verifies():
    """--verify auto's chains of L proposals (rejection rows) fill L + 1 draft positions, not the whole block: the
    drafter's work grows with them. The committed tokens are the target's either way."""
    e = engine(good=7, block_size=8)
    blocks = []
    propose = e.drafter.propose
    e.drafter.propose = lambda ids, pending, block_size, *a, **k: blocks.append(block_size) or propose(
        ids, pending, block_size, *a, **k)
    first = e.prefill([[1, 2, 3]])[0]
    steps = chain_cycle(e, [first], length=3)
    assert blocks == [4] and len(steps[0].tokens) == 4 and steps[0].verified == 3
    assert e.rows[0][3:] == reference([1, 2, 3], 4)[:4]
    in_sync(e)
