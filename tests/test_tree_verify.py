"""Tree verification through the engine on both backends: lossless greedy trees (with walks into non-first
children), exact sampling, the cache after a tree commit, torch == MLX, batched rows == batch 1, refusals, auto."""

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.drafter import DFlashDrafter, load_drafter
from dflash.backends.torch.target import load_target
from dflash.core.contract import Draft
from dflash.core.errors import DFlashError
from dflash.core.loop import generate, generate_batch
from dflash.core.sampling import SamplingParams

from dflash.reference import tiny

from cycle_devices import FixedTimes
from paused import STEEP, check_paused_cycles
from test_sampling import PROMPT, V, chi_square_ok, exact_next, small_vocab_target  # noqa: F401  (fixture)

# a GPU-like device (verifying more costs little) and a CPU-like one (every verified token costs)
FLAT = FixedTimes(plain=1.0, token=0.3 / 511, draft=0.3)


@pytest.fixture(scope="module")
def trained(trained_pair):
    target_dir, draft_dir = trained_pair
    model = load_target(target_dir, torch.float32, "cpu")
    g = torch.Generator().manual_seed(321)  # prompts the drafter's training never saw
    prompts = torch.randint(3, 500, (20, 8), generator=g).tolist()
    baseline = [generate(torch_engine(model), p, max_new_tokens=128).tokens for p in prompts]
    return model, load_drafter(draft_dir), prompts, baseline


def non_first_child(tree, path) -> bool:
    """The walk went into a node that has an earlier sibling."""
    return any(tree.parents.index(tree.parents[i]) < i for i in path)


class Recorder:
    def __init__(self, backend):
        self.backend, self.trees = backend, []
        step = backend.step

        def recording(anchors):
            out = step(anchors)
            trees = backend.policy.planner
            self.trees += list(zip(trees.last_trees, trees.last_paths))
            return out
        backend.step = recording


@pytest.mark.parametrize("mode,budget", [("tree", 4), ("tree", 15), ("tree", 48), ("auto", 32)])
def test_greedy_tree_is_lossless(trained, mode, budget):
    model, drafter, prompts, baseline = trained
    backend = torch_engine(model, drafter, block_size=16)
    backend.set_verify(mode, budget, FLAT)
    if mode == "auto":  # its chain-or-tree choice follows wall time (tests/test_tree.py); here the tree rule
        backend.policy.planner.path = lambda *_: "tree"
    rec = Recorder(backend)
    lengths = []
    for p, ref in zip(prompts, baseline):
        r = generate(backend, p, max_new_tokens=128)
        assert r.tokens == ref
        assert r.verify_mode == mode and len(r.verified) == len(r.acceptance_lengths)
        lengths += r.acceptance_lengths
    assert any(non_first_child(t, p) for t, p in rec.trees), "no walk ever left the first child"
    assert max(t.nodes for t, _ in rec.trees) <= budget
    if budget >= 15:  # a tree of the chain's verify tokens or more accepts at least what the chain does
        chain = torch_engine(model, drafter, block_size=16)
        chain_lengths = [n for p in prompts for n in generate(chain, p, max_new_tokens=128).acceptance_lengths]
        assert sum(lengths) / len(lengths) >= sum(chain_lengths) / len(chain_lengths)


def test_cache_after_a_tree_commit_equals_feeding_the_accepted_tokens(trained):
    model, drafter, prompts, _ = trained
    backend = torch_engine(model, drafter, block_size=16)
    backend.set_verify("tree", 24)
    rec = Recorder(backend)
    (first,) = backend.prefill([prompts[0]])
    anchor, gathered = first, False
    for _ in range(6):
        (step,) = backend.step([anchor])
        anchor = step.tokens[-1]
        tree, path = rec.trees[-1]
        gathered |= path != list(range(1, len(path) + 1))  # kept slots that were not a prefix of the forward
    assert gathered, "no commit had to gather the accepted path"
    probe = backend.target.ids([[anchor]])
    logits, features = backend.target.forward(probe, last_only=False)
    fresh = torch_engine(model, drafter)
    ref_logits, ref_features = fresh.target.forward(fresh.target.ids([backend.tokens + [anchor]]), last_only=False)
    torch.testing.assert_close(logits[0, -1], ref_logits[0, -1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(features[0, -1], ref_features[0, -1], rtol=1e-4, atol=1e-4)


def test_batched_trees_equal_batch_one(trained):
    model, drafter, prompts, baseline = trained
    backend = torch_engine(model, drafter, block_size=16)
    for mode in ("tree", "auto"):
        backend.set_verify(mode, 12, STEEP)
        results = generate_batch(backend, prompts[:6], max_new_tokens=96)
        assert [r.tokens for r in results] == [b[:96] for b in baseline[:6]]
        assert all(r.verify_mode == mode for r in results)


def test_batched_rows_mode_cache_after_tree_commit(trained):
    """Rows sharing one cache keep their accepted paths as holes; the next forward sees what batch 1 sees."""
    model, drafter, prompts, _ = trained
    backend = torch_engine(model, drafter, block_size=16)
    backend.set_verify("tree", 20)
    anchors = backend.prefill(prompts[:3])
    for _ in range(4):
        anchors = [s.tokens[-1] for s in backend.step(anchors)]
    logits, _ = backend.target.forward(backend.target.ids([[a] for a in anchors]), last_only=False)
    for i, a in enumerate(anchors):
        fresh = torch_engine(model)
        ref, _ = fresh.target.forward(fresh.target.ids([backend.rows[i] + [a]]), last_only=False)
        torch.testing.assert_close(logits[i, -1], ref[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["tree", "auto"])
def test_static_cache_trees_are_lossless(trained, monkeypatch, mode):
    """Trees on the static cache of --compile (run eagerly here: the same windowed code), across a window change:
    the accepted path moves within the buffer and the output is target-only's."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    model, drafter, prompts, baseline = trained
    static = torch_engine(model, drafter, cache_len=512, compile=True)
    static.set_verify(mode, 20, FLAT)
    if mode == "auto":
        static.policy.planner.path = lambda *_: "tree"
    assert static.verify_mode == mode
    rec = Recorder(static)
    for p, ref in zip(prompts[:4], baseline):
        r = generate(static, p, max_new_tokens=128)
        assert r.tokens == ref and r.verify_mode == mode
    assert any(non_first_child(t, p) for t, p in rec.trees), "no walk ever left the first child"
    long = (prompts[0] * 40)[:240]  # 240 + 64 positions: the windows 256 and 512
    assert generate(static, long, max_new_tokens=64).tokens == generate(torch_engine(model), long,
                                                                        max_new_tokens=64).tokens


def test_bad_verify_flags(trained):
    model, drafter, _, _ = trained
    backend = torch_engine(model, drafter)
    with pytest.raises(DFlashError, match="--verify: got 'trees'"):
        backend.set_verify("trees")
    with pytest.raises(DFlashError, match="--tree-budget: got 0"):
        backend.set_verify("tree", 0)


def test_auto_with_an_untrained_drafter_mostly_skips_the_draft(tiny_target_dir, random_draft_dir, prompts):
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    backend = torch_engine(model, load_drafter(random_draft_dir), block_size=16)
    backend.set_verify("auto", None, STEEP)
    ar = torch_engine(model)
    skipped = cycles = 0
    for p in prompts[:6]:
        r = generate(backend, p, max_new_tokens=64)
        assert r.tokens == generate(ar, p, max_new_tokens=64).tokens
        skipped += r.cycles_without_draft
        cycles += len(r.acceptance_lengths)
    assert skipped > cycles / 2, f"{skipped} of {cycles} cycles skipped the draft"
    # a batch pauses drafting too (the drafter absorbs each row's new features in the cycles without a draft)
    batch = generate_batch(backend, prompts[:3], max_new_tokens=32)
    assert [r.tokens for r in batch] == [generate(ar, p, max_new_tokens=32).tokens for p in prompts[:3]]
    assert all(r.cycles_without_draft > len(r.acceptance_lengths) / 2 for r in batch)


def test_a_paused_cycle_is_the_plain_step(tiny_target_dir, random_draft_dir, prompts):
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    check_paused_cycles(torch_engine(model, load_drafter(random_draft_dir), block_size=16), torch_engine(model),
                        prompts[0])


# ---- sampling ------------------------------------------------------------------------------------------------------
class OracleTopK:
    """A Drafter whose per-depth top-k is the target's own top-k along its greedy path (the tree then branches
    where the target's samples go, so the walk takes first and other children often)."""

    distribution = False
    drafts_some_rows = False

    def __init__(self, model, engine, k=3):
        self.model, self.engine, self.k = model, engine, k
        self.position = 0

    @torch.no_grad()
    def propose(self, anchor_ids, pending, block_size, top_k=0, draws=None, rows=None):
        temperature = draws[0].params.temperature if draws else 1.0
        seq = self.engine.tokens + anchor_ids[0].tolist()
        ids, probs = [], []
        for _ in range(block_size - 1):
            p = torch.softmax(self.model(torch.tensor([seq])).logits[0, -1] / temperature, -1)
            top = p.topk(self.k)
            ids.append(top.indices.tolist())
            probs.append(top.values.tolist())
            seq = seq + [ids[-1][0]]
        greedy = torch.tensor([[anchor_ids[0, 0].item()] + [r[0] for r in ids]])
        return Draft(greedy, torch.tensor([ids]), torch.tensor([probs]))

    def extend(self, pending):
        pass

    def crop(self, position):
        return True

    def reset(self):
        pass

    def state(self):
        return []


def oracle_engine(model, budget):
    engine = torch_engine(model)
    engine.drafter, engine.block_size = OracleTopK(model, engine), 4
    engine.set_verify("tree", budget)
    return engine


def empirical_pairs(engine, params, n, first=1):
    """Counts of (t_first, t_first+1) over n seeded generations."""
    observed = torch.zeros(V, V, dtype=torch.float64)
    descended = 0
    for i in range(n):
        r = generate(engine, PROMPT, max_new_tokens=first + 2, sampling=SamplingParams(**{**params.__dict__,
                                                                                        "seed": i}))
        observed[r.tokens[first - 1], r.tokens[first]] += 1
        trees = engine.policy.planner
        descended += any(non_first_child(t, p) for t, p in zip(trees.last_trees, trees.last_paths))
    return observed, descended


def exact_pairs(model, params, first=1):
    """P(t_first, t_first+1): the joint of the first two tokens (first=1), or of the second and third (first=2)."""
    if first == 1:
        p1 = exact_next(model, PROMPT, params)
        return torch.stack([p1[t] * exact_next(model, PROMPT + [t], params) for t in range(V)])
    p1 = exact_next(model, PROMPT, params)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for t1 in range(V):
        if p1[t1] == 0:
            continue
        p2 = exact_next(model, PROMPT + [t1], params)
        for t2 in range(V):
            if p2[t2] > 0:
                joint[t2] += p1[t1] * p2[t2] * exact_next(model, PROMPT + [t1, t2], params)
    return joint


@pytest.mark.parametrize("params,first", [
    (SamplingParams(temperature=1.0), 1),
    (SamplingParams(temperature=1.0), 2),
    (SamplingParams(temperature=0.7, top_k=4), 1),
    (SamplingParams(temperature=1.0, top_p=0.7), 2),
], ids=["temperature-t1t2", "temperature-t2t3", "top-k", "top-p-t2t3"])
def test_tree_sampling_matches_the_target_distribution(small_vocab_target, params, first):  # noqa: F811
    model, n = small_vocab_target, 500
    observed, descended = empirical_pairs(oracle_engine(model, 8), params, n, first)
    assert descended > n * 0.05, "the walk should take non-first children under sampling"
    joint = exact_pairs(model, params, first)
    assert observed[joint == 0].sum() == 0, "sampled a pair the processors exclude"
    ok, why = chi_square_ok(observed[joint > 0], joint[joint > 0] * n)
    assert ok, why


def test_a_wrong_walk_fails_the_same_test(small_vocab_target, monkeypatch):  # noqa: F811
    """Power: a walk that follows the drafter's first child whatever the target drew is rejected."""
    from dflash.core import tree as tree_module

    def follow_first_child(self, target):
        node, path = 0, []
        while node in self.parents:
            node = self.parents.index(node)
            path.append(node)
        return path, target[node]

    monkeypatch.setattr(tree_module.Tree, "walk", follow_first_child)
    model, params, n = small_vocab_target, SamplingParams(temperature=1.0), 500
    observed, _ = empirical_pairs(oracle_engine(model, 8), params, n, 1)
    joint = exact_pairs(model, params, 1)
    ok, _ = chi_square_ok(observed[joint > 0], joint[joint > 0] * n)
    assert not ok


def test_repetition_penalty_sees_each_nodes_own_path(small_vocab_target):  # noqa: F811
    """Greedy with a repetition penalty: node j's history is its own root path, so tree == target-only."""
    model = small_vocab_target
    params = SamplingParams(repetition_penalty=1.8)
    ref = generate(torch_engine(model), PROMPT, max_new_tokens=24, sampling=params).tokens
    assert generate(oracle_engine(model, 8), PROMPT, max_new_tokens=24, sampling=params).tokens == ref


def test_untrained_torch_drafter_tree_is_lossless(small_vocab_target):  # noqa: F811
    torch.manual_seed(3)
    drafter = DFlashDrafter(tiny.draft_spec_for(small_vocab_target.name_or_path, num_layers=1, block_size=4,
                                                mask_token_id=V - 1)).eval()
    backend = torch_engine(small_vocab_target, drafter, block_size=4)
    backend.set_verify("tree", 6)
    ref = generate(torch_engine(small_vocab_target), PROMPT, max_new_tokens=40).tokens
    assert generate(backend, PROMPT, max_new_tokens=40).tokens == ref
