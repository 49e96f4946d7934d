"""The engine (dflash/core/engine.py) against pure-numpy primitives: what the caches hold after prefill, commit, crop,
admit and retire, for one row and for many. The fake target's features are the token ids themselves, so the
drafter's context can be checked against the committed tokens exactly."""

import numpy as np
import pytest

from dflash.core.contract import Draft
from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.loop import generate, generate_batch

V = 64


def next_token(history):
    return (history[-1] * 5 + len(history)) % V


class FakeTarget:
    info = None
    max_context = 200

    def __init__(self, bounded=False):
        self.rows: list[list[int]] = []  # what each row's "KV cache" holds
        self.forwards, self.bounded, self.last = [], bounded, 0

    # arrays
    ids = staticmethod(lambda rows: np.array(rows, dtype=np.int64))
    cat = staticmethod(lambda parts: np.concatenate(parts, axis=1))
    head = staticmethod(lambda f, n: f[:, :n])
    take_rows = staticmethod(lambda f, rows: f[rows])
    pad_rows = staticmethod(lambda f, n: np.concatenate([f, np.zeros((n, *f.shape[1:]))]))
    to_host = staticmethod(lambda x: x.tolist())

    def settle(self, *arrays):
        pass

    def set_sampling(self, params):
        pass

    def sample(self, logits, histories, block, paths=None, draws=None, draft=None):
        return logits.argmax(-1)

    def forward(self, ids, last_only):
        if not self.rows:
            self.rows = [[]]
        assert ids.shape[0] == len(self.rows)
        self.forwards.append(ids.shape[1])
        logits = np.zeros((*ids.shape, V))
        for r, row in enumerate(self.rows):
            for t, tok in enumerate(ids[r]):
                row.append(int(tok))
                logits[r, t, next_token(row)] = 1
        self.last = ids.shape[1]
        features = ids[..., None].astype(float)
        return (logits[:, -1:] if last_only else logits), features

    def keep(self, keeps, width):
        for row, k in zip(self.rows, keeps):
            del row[len(row) - width + k:]
        return True

    def trim(self, n):
        if self.bounded and n > self.last:  # like a recurrent layer: nothing before the last forward
            return False
        del self.rows[0][len(self.rows[0]) - n:]
        self.last -= n
        return True

    def reset(self):
        self.rows = []

    def close(self):
        pass

    def check_batchable(self):
        pass

    def spawn(self):
        return FakeTarget(self.bounded)

    def merge(self, other):
        self.rows += other.rows

    def select(self, rows):
        self.rows = [self.rows[i] for i in rows]


class FakeDrafter:
    """Context = the features (token ids) it was given; proposes the target's continuation for `good` slots."""

    def __init__(self, good=3):
        self.context: list[list[int]] = [[]]
        self.good = good

    @property
    def position(self):
        return len(self.context[0])

    def _absorb(self, pending):
        if pending is None:
            return
        for r, n in enumerate(pending.counts):
            self.context[r] += [int(x) for x in pending.features[r, :n, 0]]

    def extend(self, pending):
        self._absorb(pending)

    def propose(self, anchor_ids, pending, block_size, top_k=0, draws=None):
        self._absorb(pending)
        rows = []
        for r, (anchor,) in enumerate(anchor_ids.tolist()):
            hist, block = self.context[r] + [anchor], [anchor]
            for i in range(block_size - 1):
                t = next_token(hist) if i < self.good else (next_token(hist) + 1) % V
                block.append(t)
                hist.append(t)
            rows.append(block)
        return Draft(np.array(rows))

    def crop(self, position):
        del self.context[0][position:]
        return True

    def reset(self):
        self.context = [[]]

    def spawn(self):
        return FakeDrafter(self.good)

    def merge(self, other):
        self.context += other.context

    def select(self, rows):
        self.context = [self.context[i] for i in rows]


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
        e.draft([o[-1] for o in outs])
        drafted, target = e.verify()
        keeps = []
        for o, d, t in zip(outs, drafted, target):
            n = next((i for i, (a, b) in enumerate(zip(d, t)) if a != b), len(d))
            o.extend(t[:n + 1])
            keeps.append(n + 1)
        e.commit(keeps)
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
