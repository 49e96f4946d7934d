"""DFlash2 drafters (DFlash2DraftModel): the convolution and the selector against their formulas written out,
greedy speculative output equal to target-only output on both backends with long and partial acceptances, the
logit / embedding scales, and strict loading of the DFlash2 keys."""

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

from dflash import backends  # noqa: E402
pytest.importorskip("torch")
from dflash.backends.torch.draft_runner import TorchDraft  # noqa: E402
from dflash.backends.torch.drafter import CandidateSelector, DynamicConv, load_drafter, scale_logits  # noqa: E402
from dflash.backends.torch.ops import TorchOps  # noqa: E402
from dflash.backends.torch.target import load_target  # noqa: E402
from dflash.backends.torch.target_runner import TorchTarget  # noqa: E402
from dflash.core.engine import Engine  # noqa: E402
from dflash.core.rules import walk  # noqa: E402
from dflash.core.errors import DFlashError  # noqa: E402
from dflash.core.loop import generate  # noqa: E402

from test_sampling_rules import lossless, sampled  # noqa: E402  (the same draws and bound as DFlash's rules)


def held_out_prompts(n=6, length=8, seed=321):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n, length), generator=g).tolist()


# ---- the arithmetic, against the formulas --------------------------------------------------------------------------
def naive_convolve(conv, x, delta, side):
    """y_t[c] = sum_j (base[side, j, c] + delta_t[j, c // group]) * x_{t-j}[c], nothing before the block."""
    rows, length, hidden = x.shape
    group = hidden // conv.groups
    out = torch.zeros_like(x)
    for r in range(rows):
        for t in range(length):
            for c in range(hidden):
                for j in range(conv.taps):
                    if t - j >= 0:
                        out[r, t, c] += (conv.base_kernel[side, j, c] + delta[r, t, j, c // group]) * x[r, t - j, c]
    return out


def test_convolution_is_the_formula_and_stays_inside_the_block():
    torch.manual_seed(0)
    conv = DynamicConv(32, 2, 16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        prepared, delta1 = conv.prepare(x)
        delta = conv.kernel_projection(x).view(2, 5, 2, 2, 2)
        torch.testing.assert_close(prepared, naive_convolve(conv, x, delta[:, :, 0], 0))
        y = torch.randn(2, 5, 32)
        torch.testing.assert_close(conv.convolve(y, delta1, 1), naive_convolve(conv, y, delta[:, :, 1], 1))
        # the block's first position has no earlier tap: its output only depends on itself
        changed = x.clone()
        changed[:, 1:] += 1.0
        assert torch.equal(conv.prepare(changed)[0][:, 0], prepared[:, 0])


def naive_walk(selector, logits, hidden, anchor, top_k):
    tokens, previous = [], anchor
    for t in range(logits.shape[0]):
        unary, candidates = logits[t].topk(top_k)
        context = selector.predecessor_codebook[previous] * selector.hidden_projection(hidden[t])
        scores = [unary[j] + (context * selector.successor_codebook[candidates[j]]).sum() for j in range(top_k)]
        previous = int(candidates[int(torch.stack(scores).argmax())])
        tokens.append(previous)
    return tokens


def test_selector_walk_is_the_greedy_pair_score_walk():
    torch.manual_seed(0)
    selector = CandidateSelector(32, 100, 8)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_()
        logits, hidden = torch.randn(3, 7, 100) * 3, torch.randn(3, 7, 32)
        anchor = torch.tensor([[5], [17], [99]])
        tokens, _ = walk(TorchOps, *selector.pair_scores(logits, hidden, anchor, 16))
        for r in range(3):
            assert tokens[r].tolist() == naive_walk(selector, logits[r], hidden[r], int(anchor[r, 0]), 16)
        assert not torch.equal(tokens, logits.argmax(-1))  # the pair term changes choices (not the plain argmax)


def test_mlx_selector_and_convolution_agree_with_torch():
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    from dflash.backends.mlx import drafter as mlx_drafter
    from dflash.backends.mlx.ops import MLXOps

    torch.manual_seed(1)
    selector, conv = CandidateSelector(32, 100, 8), DynamicConv(32, 2, 16)
    with torch.no_grad():
        for p in [*selector.parameters(), *conv.parameters()]:
            p.normal_()
    m_selector, m_conv = mlx_drafter.CandidateSelector(32, 100, 8), mlx_drafter.DynamicConv(32, 2, 16)
    to_mx = lambda t: mx.array(t.detach().numpy())  # noqa: E731
    m_selector.load_weights([(k, to_mx(v)) for k, v in selector.state_dict().items()], strict=True)
    m_conv.load_weights([(k, to_mx(v)) for k, v in conv.state_dict().items()], strict=True)
    logits, hidden, x = torch.randn(2, 7, 100) * 3, torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    anchor = torch.tensor([[5], [17]])
    with torch.no_grad():
        want = walk(TorchOps, *selector.pair_scores(logits, hidden, anchor, 16))[0]
        got = walk(MLXOps, *m_selector.pair_scores(to_mx(logits), to_mx(hidden), to_mx(anchor), 16))[0]
        assert np.array(got).tolist() == want.tolist()
        np.testing.assert_allclose(np.array(m_conv.prepare(to_mx(x))[0]), conv.prepare(x)[0].numpy(), rtol=1e-5,
                                   atol=1e-5)
    for multiplier, cap in ((2.0, None), (1.0, 3.0), (0.5, 2.0)):
        want = scale_logits(logits, multiplier, cap)
        torch.testing.assert_close(want, cap * torch.tanh(logits * multiplier / cap) if cap else logits * multiplier)
        np.testing.assert_allclose(np.array(mlx_drafter.scale_logits(to_mx(logits), multiplier, cap)), want.numpy(),
                                   rtol=1e-5, atol=1e-5)


# ---- the engine: lossless greedy decoding ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_greedy_output_equals_target_only_with_long_and_partial_acceptance(dflash2_pair, backend):
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    target_dir, draft_dir = dflash2_pair
    pkg = backends.get(backend)
    spec_run = pkg.load(target_dir, draft_dir, dtype="float32", device="cpu")
    plain = pkg.load(target_dir, None, dtype="float32", device="cpu")
    assert spec_run.drafter.drafter.spec.is_dflash2
    lengths = []
    for p in held_out_prompts():
        got = generate(spec_run, p, max_new_tokens=64)
        assert got.tokens == generate(plain, p, max_new_tokens=64).tokens
        lengths += got.acceptance_lengths
    assert max(lengths) >= 12, f"no long acceptance: {lengths}"
    assert any(2 <= a < 16 for a in lengths), f"no partial acceptance: {lengths}"


def test_random_dflash2_drafter_is_lossless_at_every_block_size(tiny_target_dir, random_dflash2_dir, prompts):
    pkg = backends.get("torch")
    plain = pkg.load(tiny_target_dir, None, dtype="float32", device="cpu")
    for block in (2, 8):
        run = pkg.load(tiny_target_dir, random_dflash2_dir, dtype="float32", device="cpu", block_size=block)
        for p in prompts[:3]:
            assert generate(run, p, max_new_tokens=40).tokens == generate(plain, p, max_new_tokens=40).tokens


# ---- scales ------------------------------------------------------------------------------------------------------
def with_config(src, dst, **dflash_config):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dflash_config"].update(dflash_config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def first_draft(run, prompt):
    (first,) = run.prefill([prompt])
    d = run.draft([first], top_k=8)
    return d.ids, d.top_ids, d.top_probs


def test_output_multiplier_scales_the_draft_logits(tiny_target_dir, random_draft_dir, random_dflash2_dir, tmp_path,
                                                   prompts):
    """DFlash and DFlash2 alike: with output_multiplier 2 the log-odds of the draft's top-k double."""
    pkg = backends.get("torch")
    for name, src in (("dflash", random_draft_dir), ("dflash2", random_dflash2_dir)):
        scaled = with_config(src, tmp_path / name, output_multiplier=2.0)
        _, ids, probs = first_draft(pkg.load(tiny_target_dir, src, dtype="float32", device="cpu"), prompts[0])
        _, ids2, probs2 = first_draft(pkg.load(tiny_target_dir, scaled, dtype="float32", device="cpu"), prompts[0])
        assert torch.equal(ids, ids2)
        odds, odds2 = probs.log() - probs.log()[..., :1], probs2.log() - probs2.log()[..., :1]
        torch.testing.assert_close(odds2, 2 * odds, rtol=1e-3, atol=1e-3)


def test_scales_agree_across_backends(tiny_target_dir, random_dflash2_dir, tmp_path, prompts):
    pytest.importorskip("mlx_lm")
    import numpy as np

    scaled = with_config(random_dflash2_dir, tmp_path / "scaled", output_multiplier=1.5, final_logit_softcapping=4.0,
                         input_embedding_scale=0.5)
    runs = [backends.get(b).load(tiny_target_dir, scaled, dtype="float32", device="cpu") for b in ("torch", "mlx")]
    unscaled = backends.get("torch").load(tiny_target_dir, random_dflash2_dir, dtype="float32", device="cpu")
    (ti, tk, tp), (mi, mk, mp) = [[np.array(a) for a in first_draft(r, prompts[1])] for r in runs]
    assert (ti == mi).all() and (tk == mk).all()
    np.testing.assert_allclose(tp, mp, rtol=1e-4, atol=1e-5)
    assert tp.max() < 1 / (1 + 7 * np.exp(-8.0)) + 1e-6  # softcap 4: top-8 logits within 8 of each other
    assert not np.allclose(tp, np.array(first_draft(unscaled, prompts[1])[2]))


# ---- strict loading ------------------------------------------------------------------------------------------------
def edited_weights(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def drop(name):
    return lambda s: s.pop(name)


def add(name):
    return lambda s: s.__setitem__(name, torch.zeros(3))


def reshape(name):
    return lambda s: s.__setitem__(name, torch.zeros(2, 3, s[name].shape[-1]))


@pytest.mark.parametrize("edit, key, what", [
    (drop("candidate_selector.successor_codebook"), "candidate_selector.successor_codebook", "missing"),
    (drop("layers.1.mlp_conv.kernel_projection.weight"), "layers.1.mlp_conv.kernel_projection.weight", "missing"),
    (add("candidate_selector.predecessor_codebook.weight"), "candidate_selector.predecessor_codebook.weight",
     "unexpected"),
    (reshape("layers.0.attention_conv.base_kernel"), "layers.0.attention_conv.base_kernel", "shape"),
])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_strict_loading_names_the_key(random_dflash2_dir, tmp_path, edit, key, what, backend):
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    bad = edited_weights(random_dflash2_dir, tmp_path / "bad", edit)
    with pytest.raises(DFlashError) as e:
        backends.get(backend).load_drafter(bad)
    message = str(e.value)
    assert "\n" not in message and key in message and what in message, message


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_unknown_architecture_is_one_line(random_dflash2_dir, tmp_path, backend):
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    bad = tmp_path / "arch"
    shutil.copytree(random_dflash2_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["DFlash3DraftModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        backends.get(backend).load_drafter(bad)
    message = str(e.value)
    assert "\n" not in message and "architectures" in message and "DFlash3DraftModel" in message
    assert "DFlash2DraftModel" in message


def test_loaded_drafter_is_the_saved_one(random_dflash2_dir):
    from safetensors.torch import load_file

    model = load_drafter(random_dflash2_dir)
    saved = load_file(str(random_dflash2_dir / "model.safetensors"))
    state = model.state_dict()
    assert set(state) == set(saved)
    assert all(torch.equal(state[k], saved[k]) for k in saved)


# ---- sampling: exact rejection sampling against the selector's distribution -----------------------------------------
V = 16


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A 16-token target (sharp enough to matter) and a random DFlash2 drafter whose 16 candidates are the whole
    vocabulary, so q is a full distribution that overlaps p only partly."""
    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny
    from tiny_pair import dflash2_from

    d = tmp_path_factory.mktemp("v16")
    model = tiny.build_target(d, vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64, seed=5, init_std=0.3).eval()
    torch.manual_seed(4)
    spec = tiny.draft_spec_for(d, num_layers=1, block_size=4, mask_token_id=V - 1)
    drafter = dflash2_from(DFlashDrafter(spec), tiny.dflash2_spec(spec, selector_rank=8), conv_noise=0.3,
                           selector_scale=0.5, seed=4)
    save_drafter(drafter, d / "draft")
    return model, drafter, d


N = 1200


@pytest.mark.parametrize("accept, backend", [("rejection", "torch"), ("match", "torch"),
                                             pytest.param("rejection", "mlx", marks=pytest.mark.slow)])
def test_both_rules_are_lossless(small_vocab_pair, accept, backend):
    """The 2nd and 3rd tokens (both committed by the first cycle when it accepts, the 3rd from position 2 of the
    block) follow target-only sampling, under either rule."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    observed, depth = sampled(small_vocab_pair, accept, backend, n=N)
    assert depth[1:].sum() > N * 0.15  # the rule decides often...
    if accept == "rejection":  # ...and at position 2 too (the greedy walk's second token rarely survives a match)
        assert depth[2:].sum() > N * 0.02
    ok, why = lossless(small_vocab_pair, observed)
    assert ok, why


@pytest.mark.slow
def test_accepting_every_sampled_draft_would_fail(small_vocab_pair, monkeypatch):
    """Power: emitting the drafter's samples unchecked (a wrong rule) is rejected by the same bound."""
    from dflash.backends.torch import target_runner

    monkeypatch.setattr(target_runner, "rejection_tokens",
                        lambda p, drafted, q_ids, q_probs, accept_u, residual_u, bonus: torch.cat([drafted, bonus[None]]))
    observed, _ = sampled(small_vocab_pair, "rejection", n=N)
    ok, _ = lossless(small_vocab_pair, observed)
    assert not ok


def test_rejection_tokens_keep_the_draft_or_redraw_elsewhere():
    from dflash.backends.torch.sampling import rejection_tokens

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 10), -1)
    q_ids = torch.arange(10).repeat(3, 1)
    bonus = torch.tensor(7)
    draws = lambda: (torch.rand(3, generator=g), torch.rand(3, generator=g))  # noqa: E731
    same = rejection_tokens(p, torch.tensor([1, 2, 3]), q_ids, p[:-1], *draws(), bonus)  # q == p: always accepted
    assert same.tolist() == [1, 2, 3, 7]
    q = torch.zeros(3, 10)
    q[:, 0] = 1.0  # q certain of token 0 where p gives it less: a rejection redraws a token other than 0
    redrawn = [rejection_tokens(p, torch.zeros(3, dtype=torch.long), q_ids, q, *draws(), bonus) for _ in range(50)]
    assert any((r[:3] != 0).any() for r in redrawn)
    assert all(((r[:3] == 0) | (p[:-1].gather(1, r[:3, None])[:, 0] > 0)).all() for r in redrawn)


def test_batched_rows_equal_their_single_outputs(tiny_target_dir, random_dflash2_dir, prompts):
    from dflash.core.loop import generate_batch

    run = backends.get("torch").load(tiny_target_dir, random_dflash2_dir, dtype="float32", device="cpu")
    batch = generate_batch(run, prompts[:3], max_new_tokens=24, trace=True)
    for p, got in zip(prompts[:3], batch):
        single = generate(run, p, max_new_tokens=24, trace=True)
        assert got.tokens == single.tokens and got.drafted == single.drafted


def test_compiled_fixed_shape_path_gives_the_same_drafts(tiny_target_dir, random_dflash2_dir, prompts):
    """compile=True (static caches, the drafter compiled at fixed shapes; the selector runs after it)."""
    eager = backends.get("torch").load(tiny_target_dir, random_dflash2_dir, dtype="float32", device="cpu")
    model = load_target(tiny_target_dir, torch.float32, "cpu")
    drafter = load_drafter(random_dflash2_dir, torch.float32, "cpu")
    # the target's compiled verify forward is the same whatever drafts for it (tests/test_fast_path.py compiles it):
    # here it runs eagerly on its static cache, so the compile time goes to DFlash2's own layers
    target = TorchTarget(model, drafter.spec.target_layer_ids, cache_len=256)
    block = drafter.spec.block_size
    draft = TorchDraft(drafter, model.get_input_embeddings(), model.get_output_embeddings(),
                       static_capacity=256 + 2 * block, logit_scaling=drafter.spec.logit_scaling(target.info))
    compiled = Engine(target, draft, block_size=block, name="torch")
    a = generate(eager, prompts[0], max_new_tokens=24, trace=True)
    b = generate(compiled, prompts[0], max_new_tokens=24, trace=True)
    assert a.tokens == b.tokens and a.drafted == b.drafted
