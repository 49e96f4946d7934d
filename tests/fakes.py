"""Pure-numpy primitives that speak the backend contract (dflash/core/contract.py): a target whose greedy token is a
function of the history, and a drafter that proposes that continuation for its first `good` block positions, then
a wrong token. The engine, the loop and the contract tests run over them."""

from collections import Counter

import numpy as np

from dflash.core.contract import Capabilities, Draft

V = 64


def next_token(history, vocab=V):
    """The fake target's greedy continuation: a function of the history alone."""
    return (history[-1] * 5 + len(history)) % vocab


class FakeTarget:
    """Its features are the token ids themselves, so the drafter's context can be checked against the committed
    tokens exactly. bounded: like a recurrent layer, it cannot go back past its last forward."""

    info = None
    max_context = 200
    capabilities = Capabilities(tree_refusal="a fake target verifies chains only")

    def __init__(self, bounded=False, rule=next_token, vocab=V):
        self.rows: list[list[int]] = []  # what each row's "KV cache" holds
        self.forwards, self.bounded, self.last = [], bounded, 0
        self.rule, self.vocab = rule, vocab
        if bounded:
            self.capabilities = Capabilities(batch_refusal="a bounded fake target runs one row",
                                             tree_refusal="a fake target verifies chains only")

    # arrays
    ids = staticmethod(lambda rows: np.array(rows, dtype=np.int64))
    cat = staticmethod(lambda parts: np.concatenate(parts, axis=1))
    head = staticmethod(lambda f, n: f[:, :n])
    take_rows = staticmethod(lambda f, rows: f[rows])
    pad_rows = staticmethod(lambda f, n: np.concatenate([f, np.zeros((n, *f.shape[1:]))]))
    to_host = staticmethod(lambda x: x.tolist())

    @staticmethod
    def gather(features, slots):
        """Row i's features at slots[i], packed to the left (padded with its last)."""
        width = max(len(s) for s in slots)
        return np.stack([features[i, s + [s[-1]] * (width - len(s))] for i, s in enumerate(slots)])

    def settle(self, drafter=None, *arrays):
        pass

    def sample(self, logits, histories, block, rows, paths=None, logprobs=None, draws=None, draft=None):
        """Greedy, each row under its own logit bias (the one setting a fake honours); with logprobs=k also (chosen,
        top-k ids, top-k log-probs) of the biased logits' log-softmax."""
        logits = logits.copy()
        for i, row in enumerate(rows):
            for token, bias in row.params.logit_bias:
                logits[i, :, token] += bias
        tokens = logits.argmax(-1)
        if logprobs is None:
            return tokens
        lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        top = np.argsort(-lp, axis=-1, kind="stable")[..., :logprobs]
        return tokens, (np.take_along_axis(lp, tokens[..., None], -1)[..., 0], top, np.take_along_axis(lp, top, -1))

    def forward(self, ids, last_only):
        if not self.rows:
            self.rows = [[]]
        assert ids.shape[0] == len(self.rows)
        self.forwards.append(ids.shape[1])
        logits = np.zeros((*ids.shape, self.vocab))
        for r, row in enumerate(self.rows):
            for t, tok in enumerate(ids[r]):
                row.append(int(tok))
                logits[r, t, self.rule(row)] = 1
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

    def gumbel(self, keys):
        raise AssertionError("the fake target is greedy")

    def spawn(self):
        return type(self)(self.bounded, self.rule, self.vocab)

    def merge(self, other):
        self.rows += other.rows

    def extract(self, row):
        alone = self.spawn()
        alone.rows = [list(self.rows[row])]
        return alone

    def cache_bytes(self):
        return 8 * sum(len(row) for row in self.rows)

    def select(self, rows):
        self.rows = [self.rows[i] for i in rows]


class LazyFakeTarget(FakeTarget):
    """A FakeTarget that declares Pipelining (dflash/core/contract.py), as a lazy one does: its plain steps run one
    ahead. `log` records the order of its starts and host reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[str] = []

    def start(self, *arrays):
        self.log.append("start")

    def to_host(self, x):
        self.log.append("read")
        return x.tolist()


class FakeDrafter:
    """Context = the features (token ids) it was given; proposes the target's continuation for `good` slots."""

    distribution = False
    drafts_some_rows = False
    spec = None  # (no checkpoint: nothing measures a fake's costs)

    def __init__(self, good=3, rule=next_token, vocab=V):
        self.context: list[list[int]] = [[]]
        self.good, self.rule, self.vocab = good, rule, vocab

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

    def propose(self, anchor_ids, pending, block_size, top_k=0, draws=None, rows=None):
        self._absorb(pending)
        rows = []
        for r, (anchor,) in enumerate(anchor_ids.tolist()):
            hist, block = self.context[r] + [anchor], [anchor]
            for i in range(block_size - 1):
                t = self.rule(hist) if i < self.good else (self.rule(hist) + 1) % self.vocab
                block.append(t)
                hist.append(t)
            rows.append(block)
        return Draft(np.array(rows))

    def crop(self, position):
        del self.context[0][position:]
        return True

    def reset(self):
        self.context = [[]]

    def state(self):
        return []

    def spawn(self):
        return FakeDrafter(self.good, self.rule, self.vocab)

    def merge(self, other):
        self.context += other.context

    def extract(self, row):
        alone = self.spawn()
        alone.context = [list(self.context[row])]
        return alone

    def cache_bytes(self):
        return 8 * sum(len(row) for row in self.context)

    def select(self, rows):
        self.context = [self.context[i] for i in rows]


class OracleDrafter:
    """Stands in for a backend's drafter: runs it (its context bookkeeping stays real), then puts
    `proposals(row, anchor)` in place of each row's proposals. `target` turns host ids into its arrays and back."""

    def __init__(self, drafter, target, proposals):
        self.drafter, self.target, self.proposals = drafter, target, proposals

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, anchor_ids, pending, block_size, top_k=0, draws=None, rows=None):
        self.drafter.propose(anchor_ids, pending, block_size, top_k, draws, rows=rows)
        anchors = [row[0] for row in self.target.to_host(anchor_ids)]
        rows = rows if rows is not None else range(len(anchors))
        return Draft(self.target.ids([[a] + list(self.proposals(r, a)) for r, a in zip(rows, anchors)]))


class Counting:
    """Stands in for a backend's Target or Drafter and counts the calls of each of its methods by name (every other
    attribute read passes through but those in `hidden`), so a test can say which primitives a cycle used."""

    def __init__(self, inner, hidden=()):
        self.inner, self.calls, self.hidden = inner, Counter(), set(hidden)

    def __getattr__(self, name):
        if name in self.hidden:
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)
        return counted
