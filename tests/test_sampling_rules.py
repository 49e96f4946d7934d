"""Every acceptance rule is exact, per row, in any batch: chi-square tests of the emitted tokens' joint
distribution against target-only sampling (each with a power check that a subtly wrong rule fails), for every
proposal shape (q, sharpened, argmax, chosen per request) and multi-candidate rejection on trees, the drafter
invariance of coupled sample-and-match, and mixed batches of greedy, matched and rejection rows.

A 16-token target makes the joint of two consecutive tokens enumerable; a random DFlash drafter's q overlaps p only
partly, so both acceptance and rejection happen at every block position.
"""

from types import SimpleNamespace

import pytest
torch = pytest.importorskip("torch")

from dflash import backends
from dflash.backends.torch import target_runner
from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash.backends.torch.ops import TorchOps
from dflash.backends.torch.sampling import inverse_cdf
from dflash.backends.torch.target import load_target
from dflash.core import sampling as core_sampling
from dflash.core.loop import Batch, Generation, generate
from dflash.core import rules
from dflash.core.sampling import SamplingParams
from dflash.reference import tiny

from test_sampling import chi_square_ok

V = 16
PROMPT = [3, 1, 4, 1, 5]
# after this prompt the random drafter's argmax is a likely token (kept in ~25% of first cycles; ~2% after PROMPT)
ARGMAX_PROMPT = [5, 8, 8, 11, 3]
N = 1500


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("v16_dflash")
    model = tiny.build_target(d, vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64, seed=5, init_std=0.3).eval()
    torch.manual_seed(6)
    drafter = DFlashDrafter(tiny.draft_spec_for(d, num_layers=1, block_size=4, mask_token_id=V - 1)).eval()
    save_drafter(drafter, d / "draft")
    return model, drafter, d


def exact_pair(model, temperature, prompt=PROMPT):
    """P(t2, t3) of target-only sampling after the prompt, t1 summed out."""
    with torch.no_grad():
        def probs(prefixes):
            return torch.softmax(model(torch.tensor(prefixes)).logits[:, -1].double() / temperature, -1)

        p1 = probs([prompt])[0]
        p2 = probs([prompt + [a] for a in range(V)])
        p3 = probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def sampled(pair, accept, backend="torch", n=N, temperature=1.0, verify="chain", draft_temperature=0.5,
            prompt=PROMPT):
    model, drafter, directory = pair
    if backend == "torch":
        run = torch_engine(model, drafter, block_size=4)
    else:
        run = backends.get(backend).load(directory, directory / "draft", dtype="float32", device="cpu")
    run.set_verify(verify, budget=6 if verify == "tree" else None)
    observed = torch.zeros(V, V, dtype=torch.float64)
    depth = torch.zeros(4)
    for i in range(n):
        r = generate(run, prompt, max_new_tokens=3, sampling=SamplingParams(
            temperature=temperature, seed=i, accept=accept, draft_temperature=draft_temperature))
        observed[r.tokens[1], r.tokens[2]] += 1
        depth[r.acceptance_lengths[0] - 1] += 1
    assert run.accept_rules == [accept]
    return observed, depth


def lossless(pair, observed, temperature=1.0, prompt=PROMPT):
    return chi_square_ok(observed.flatten(), exact_pair(pair[0], temperature, prompt).flatten() * observed.sum())


@pytest.mark.parametrize("accept, backend", [("rejection", "torch"), ("match", "torch"),
                                             pytest.param("rejection", "mlx", marks=pytest.mark.slow),
                                             pytest.param("match", "mlx", marks=pytest.mark.slow)])
def test_chain_rules_are_exact(small_vocab_pair, accept, backend):
    """(t2, t3): t2 at block position 1, t3 at position 2 when the first draft token is accepted."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    observed, depth = sampled(small_vocab_pair, accept, backend)
    assert depth[1:].sum() > N * 0.15 and depth[2:].sum() > N * 0.02  # the rule decides at positions 1 and 2
    ok, why = lossless(small_vocab_pair, observed)
    assert ok, why


def wrong_rejection(kind):
    """The rejection rule with one subtle mistake."""
    def rule(p, drafted, q_ids, q_probs, accept_u, residual_u, bonus):
        q = torch.zeros_like(p[:-1]).scatter_(1, q_ids, q_probs)
        px, qx = p[:-1].gather(1, drafted[:, None])[:, 0], q.gather(1, drafted[:, None])[:, 0]
        if kind == "another q":  # the ratio with another q than the draft was drawn from (uniform on its support)
            qx = torch.full_like(qx, 1.0 / q_ids.shape[1])
        residual = p[:-1] if kind == "residual from p" else (p[:-1] - q).clamp(min=0)
        redrawn = inverse_cdf(residual, residual_u)
        return torch.cat([torch.where(accept_u * qx <= px, drafted, redrawn), bonus[None]])
    return rule


@pytest.mark.parametrize("kind", ["shared noise", "another q", "residual from p"])
@pytest.mark.slow
def test_subtly_wrong_rejection_rules_fail(small_vocab_pair, monkeypatch, kind):
    """Power: the same bound rejects each wrong variant."""
    if kind == "shared noise":  # the acceptance test reads the draft's own uniforms
        real = core_sampling.uniforms
        monkeypatch.setattr(core_sampling, "uniforms", lambda seed, stream, positions: real(
            seed, "draft" if stream == "accept" else stream, positions))
    else:
        monkeypatch.setattr(target_runner, "rejection_tokens", wrong_rejection(kind))
    observed, _ = sampled(small_vocab_pair, "rejection")
    ok, _ = lossless(small_vocab_pair, observed)
    assert not ok


@pytest.mark.parametrize("accept, verify, backend", [
    ("argmax", "chain", "torch"), ("sharpened", "chain", "torch"), ("shaped", "chain", "torch"),
    ("multi", "tree", "torch"),  # (the rules are written once over ArrayOps; MLX's arrays: each_rule_emits_p)
    *(pytest.param(*p, "mlx", marks=pytest.mark.slow) for p in [("argmax", "chain"), ("sharpened", "chain"),
                                                               ("multi", "tree")])])
def test_proposal_shapes_and_multi_candidate_trees_are_exact(small_vocab_pair, accept, verify, backend):
    """(t2, t3) under the one-hot proposal, q sharpened (t = 0.5), the shape chosen per request from its past
    cycles, and trees whose nodes try several one-hot children (the root's children decide t2, a depth-1 node's
    t3)."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    observed, depth = sampled(small_vocab_pair, accept, backend, verify=verify, prompt=ARGMAX_PROMPT)
    # the rule keeps the proposal and redraws at position 1 (t3 is decided at position 1 of the next cycle whenever
    # t2 is not accepted)
    assert N * 0.05 < depth[1:].sum() < N * 0.95, depth
    ok, why = lossless(small_vocab_pair, observed, prompt=ARGMAX_PROMPT)
    assert ok, why


def wrong_multi(p, draw):
    """Multi-candidate rejection whose final residual keeps the rejected children (p itself)."""
    children, counted, child_u, residual_u = (torch.as_tensor(x) for x in (draw.children, draw.counted,
                                                                            draw.child_u, draw.residual_u))
    pc = p.gather(1, children) * counted
    kept = (child_u * (1 - (pc.cumsum(1) - pc)) <= pc) & (counted > 0)
    first = kept & (kept.long().cumsum(1) == 1)
    redrawn = inverse_cdf(p, residual_u)
    return torch.where(first.any(1), (first.long() * children).sum(1), redrawn)


@pytest.mark.parametrize("accept, kind", [("argmax", "residual from p"), ("sharpened", "another q"),
                                          ("multi", "residual keeps the children")])
@pytest.mark.slow
def test_wrong_residuals_of_the_new_rules_fail(small_vocab_pair, monkeypatch, accept, kind):
    """Power: the one-hot rule whose residual forgets to remove x, the sharpened rule whose ratio reads another q
    than the one drafted from, and multi-candidate rejection whose residual keeps the rejected children."""
    if accept == "multi":
        monkeypatch.setattr(target_runner, "multi_candidate_tokens", wrong_multi)
    else:
        monkeypatch.setattr(target_runner, "rejection_tokens", wrong_rejection(kind))
    observed, _ = sampled(small_vocab_pair, accept, verify="tree" if accept == "multi" else "chain",
                          prompt=ARGMAX_PROMPT)
    ok, _ = lossless(small_vocab_pair, observed, prompt=ARGMAX_PROMPT)
    assert not ok


P8 = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])


def position_draws(rule, ops, array, n=20000):
    """n independent positions whose target distribution is P8, decided by `rule` (rules.py over `ops`): the one-hot
    proposal of token 0, q sharpened (t = 0.5) from uniform draws, and a node's children [1, 0, 4] tried in order."""
    g = torch.Generator().manual_seed(11)
    v = P8.shape[0]
    p = P8.expand(n + 1, v).contiguous()
    u1, u2, u3 = torch.rand(n, generator=g), torch.rand(n, generator=g), torch.rand(n, 3, generator=g)
    if rule == "multi":
        children = torch.tensor([[1, 0, 4]]).expand(n, 3)
        return rules.multi_candidate_tokens(ops, array(p[:-1]), array(children), array(torch.ones(n, 3)),
                                            array(u3), array(u2))
    ids = torch.arange(v).expand(n, v)
    if rule == "argmax":
        q = torch.zeros(n, v)
        q[:, 0] = 1.0
    else:  # sharpened: a q unlike p, squared and renormalised, drafted from
        q = torch.softmax(torch.linspace(1.0, -1.0, v) / 0.5, 0).expand(n, v)
    drafted = inverse_cdf(q, u1)
    return rules.rejection_tokens(ops, array(p), array(drafted), array(ids), array(q), array(u2), array(u3[:, 0]),
                                  array(torch.tensor(0)))[:-1]


@pytest.mark.parametrize("rule", ["argmax", "sharpened", "multi"])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_each_rule_emits_p_at_a_position(rule, backend):
    """Rule by rule on the backend's arrays: the emitted token is distributed as p (20000 positions)."""
    if backend == "torch":
        ops, array, host = TorchOps, lambda x: x, lambda x: x
    else:
        mx = pytest.importorskip("mlx.core")
        from dflash.backends.mlx.ops import MLXOps
        ops, host = MLXOps, lambda x: torch.tensor(x.tolist())
        array = lambda x: mx.array(x.numpy())  # noqa: E731
    tokens = host(position_draws(rule, ops, array))
    counts = torch.bincount(tokens.long(), minlength=8).double()
    ok, why = chi_square_ok(counts, P8.double() * counts.sum())
    assert ok, why


def test_a_residual_that_keeps_the_proposals_fails_at_a_position(monkeypatch):
    """Power of the position test: one-hot rejection redrawing from p (x not removed), multi keeping its rejected
    children."""
    monkeypatch.setattr(rules, "rejection_tokens", lambda ops, *args: wrong_rejection("residual from p")(*args))
    monkeypatch.setattr(rules, "multi_candidate_tokens", lambda ops, p, children, counted, child_u, residual_u:
                        wrong_multi(p, SimpleNamespace(children=children, counted=counted, child_u=child_u,
                                                       residual_u=residual_u)))
    for rule in ("argmax", "multi"):
        tokens = position_draws(rule, TorchOps, lambda x: x)
        counts = torch.bincount(tokens.long(), minlength=8).double()
        ok, _ = chi_square_ok(counts, P8.double() * counts.sum())
        assert not ok, rule


# the MLX run of the same check takes ~40 s on a Linux CPU (mlx[cpu]'s BLAS): .ci/run runs it (-m slow)
@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.slow)])
def test_matched_sampling_is_the_target_only_sample(trained_pair, prompts, backend):
    """Coupled sample-and-match emits the target's own position-keyed draw: a seeded request gives the same
    tokens with no drafter, the chain at any block size, trees and auto (whatever the budget chose)."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    pkg = backends.get(backend)
    target_dir, draft_dir = trained_pair
    runs = {"no draft": pkg.load(target_dir, None, dtype="float32", device="cpu")}
    for verify in ("chain", "tree", "auto"):
        run = pkg.load(target_dir, draft_dir, dtype="float32", device="cpu")
        run.set_verify(verify, budget=8 if verify == "tree" else None)
        runs[verify] = run
    runs["chain b4"] = pkg.load(target_dir, draft_dir, dtype="float32", device="cpu", block_size=4)
    accepted = 0
    for seed, prompt in enumerate(prompts[:4]):
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, accept="match")
        outs = {name: generate(run, prompt, max_new_tokens=48, sampling=sampling) for name, run in runs.items()}
        want = outs.pop("no draft").tokens
        for name, r in outs.items():
            assert r.tokens == want, name
        accepted += sum(n - 1 for r in outs.values() for n in r.acceptance_lengths)
    assert accepted > 20  # drafts were accepted, so the invariance is not the no-draft path's alone


def mixed_settings(accepts):
    return [SamplingParams(), SamplingParams(temperature=0.9, seed=3, accept=accepts[0]),
            SamplingParams(temperature=0.7, top_k=20, seed=4, accept=accepts[1]), SamplingParams(),
            SamplingParams(temperature=1.0, top_p=0.9, seed=5, accept="match")]


@pytest.mark.parametrize("drafter_kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("order", [[4, 2, 1, 0, 3], *(pytest.param(o, marks=pytest.mark.slow)
                                                        for o in ([0, 1, 2, 3, 4], [1, 3, 0, 4, 2]))])
def test_mixed_batches_keep_every_rows_output(trained_pair, dflash2_pair, drafter_kind, order):
    """Greedy, matched and rejection rows in one batch, joining a running batch in any order: every row's tokens
    are its batch-1 tokens (greedy: target-only greedy; seeded sampled rows: what they draw alone)."""
    target_dir, draft_dir = trained_pair if drafter_kind == "dflash" else dflash2_pair
    target, drafter = load_target(target_dir, torch.float32, "cpu"), load_drafter(draft_dir)
    settings = mixed_settings(["rejection", "rejection"] if drafter_kind == "dflash" else ["rejection", "match"])
    prompt = [5, 6, 7, 8, 9]
    want = [generate(torch_engine(target, drafter), prompt, max_new_tokens=32, sampling=s).tokens for s in settings]
    greedy = generate(torch_engine(target), prompt, max_new_tokens=32).tokens
    assert want[0] == want[3] == greedy
    run = torch_engine(target, drafter)
    batch = Batch(run)
    gens = {i: Generation(run, prompt, max_new_tokens=32, sampling=settings[i]) for i in order}
    for i in order:
        batch.join(gens[i])
        batch.step()  # rows join a running batch, one cycle apart
    rules = set(run.accept_rules)
    while batch:
        batch.step()
    assert [gens[i].result.tokens for i in range(len(settings))] == want
    assert {"greedy", "rejection"} <= rules or len(rules) > 1
