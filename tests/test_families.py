"""Issue #9: every target family that has public DFlash drafters, on both backends, through the one loop.

Families: qwen3, llama, qwen3_moe (attention, dense / MoE), qwen3_5 and qwen3_5_moe (hybrid: Gated DeltaNet linear
attention in 3 of every 4 layers + full attention), gpt_oss (sliding-window attention with sinks alternating with full
attention, MoE); and on torch gemma4 (sliding windows, per-layer inputs, layers sharing earlier K/V; mlx-lm 0.32
does not read the config transformers 5 writes for it). Tiny random targets are built here (dflash.reference.tiny's per-family
defaults, saved the way the public checkpoints are spelled).

- Lossless greedy: speculative == target-only with an untrained drafter (mostly rejections) and with an oracle
  drafter (the target's own continuation with one wrong token at a random slot of each block, so every acceptance
  length occurs), over prompts and generations longer than gpt-oss's window (16), on both backends.
- Rollback: after commit(k) a hybrid target's linear-attention layers hold what a cache fed only the accepted tokens
  holds (conv window and recurrent state); rewinding the conv window alone is measurably wrong.
- Cross-backend: torch and MLX give identical tokens and per-cycle drafts where transformers and mlx-lm implement the
  family identically. gpt-oss's YaRN uses `truncate: false`, which mlx-lm's YarnRoPE does not implement: there the
  measured logit difference is asserted (and identity once both libraries compute the same RoPE).
- Drafters with sliding-window layers honour their windows on both backends (not silently full attention).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
torch = pytest.importorskip("torch")
from fakes import OracleDrafter

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.draft_cache import DraftContextCache
from dflash.backends.torch.draft_runner import draft_step
from dflash.backends.torch.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash.backends.torch.target import load_target
from dflash.core.contract import Draft
from dflash.core.draft_context import LayerRule
from dflash.core.loop import generate
from dflash.reference import tiny

FAMILIES = ["qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss"]
HYBRID = ["qwen3_5", "qwen3_5_moe"]
FAMILY_CLASS = {"qwen3": "Qwen3For", "llama": "LlamaFor", "qwen3_moe": "Qwen3MoeFor", "qwen3_5": "Qwen3_5For",
                "qwen3_5_moe": "Qwen3_5MoeFor", "gpt_oss": "GptOssFor", "gemma4": "Gemma4For"}
B = 8
N = 40
PROMPTS = [[(7 * i * i + 3 * i + n) % 490 + 5 for i in range(n)] for n in (5, 21, 36)]
# gpt-oss with a RoPE both libraries compute alike (YaRN with truncation, which mlx-lm always applies)
YARN_TRUNCATED = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096, "truncate": True}


@dataclasses.dataclass
class Case:
    family: str
    target_dir: object
    draft_dir: object
    mlx_dir: object
    model: object = None
    refs: list | None = None  # target-only greedy continuations of PROMPTS (torch)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built: dict[str, Case] = {}

    def get(family: str, variant: str = "", **overrides) -> Case:
        key = family + variant
        if key not in built:
            d = tmp_path_factory.mktemp(key)
            tiny.build_target(d / "target", family=family, seed=0, **overrides)
            torch.manual_seed(1)
            save_drafter(DFlashDrafter(tiny.draft_spec_for(d / "target", num_layers=1, block_size=B)), d / "draft")
            case = Case(family, d / "target", d / "draft", tiny.mlx_layout(d / "target", d / "target_mlx"))
            case.model = load_target(case.target_dir, torch.float32, "cpu")
            case.refs = [generate(torch_engine(case.model), p, max_new_tokens=N).tokens for p in PROMPTS]
            built[key] = case
        return built[key]

    return get


def with_oracle(backend, seed: int = 0):
    """Let `backend` propose the reference continuation (`backend.reference`: prompt + target-only output) with one
    token per block changed at a random slot (or none): acceptances of every length, the drafter still runs."""
    rng = random.Random(seed)

    def proposals(row, anchor):
        n, b = len(backend.tokens), backend.block_size
        props = (backend.reference[n + 1:n + b] + [0] * b)[:b - 1]
        slot = rng.randrange(b)
        if slot < b - 1:
            props[slot] = props[slot] % 490 + 6
        return props

    backend.drafter = OracleDrafter(backend.drafter, backend.target, proposals)
    return backend


def check_lossless(backend, refs, oracle: bool) -> list[int]:
    lengths = []
    for p, ref in zip(PROMPTS, refs):
        backend.reference = p + ref
        r = generate(backend, p, max_new_tokens=N)
        assert r.tokens == ref
        lengths += r.acceptance_lengths
    if oracle:
        assert {1, B} <= set(lengths) and len(set(lengths)) >= 6, f"acceptances {sorted(set(lengths))}"
    return lengths


@pytest.mark.parametrize("family", FAMILIES + ["gemma4"])
def test_torch_greedy_lossless(cases, family):
    case = cases(family)
    assert type(case.model).__name__.startswith(FAMILY_CLASS[family])
    # one backend for all prompts: unrelated prompts crop the caches back (bounded ones start over)
    check_lossless(torch_engine(case.model, load_drafter(case.draft_dir), block_size=B), case.refs, oracle=False)
    oracle = with_oracle(torch_engine(case.model, load_drafter(case.draft_dir), block_size=B))
    check_lossless(oracle, case.refs, oracle=True)
    # a prompt prefilled in chunks (bounded caches record and trim across chunk forwards)
    chunked = torch_engine(case.model, load_drafter(case.draft_dir), block_size=B, prefill_chunk=7)
    assert generate(chunked, PROMPTS[2], max_new_tokens=N).tokens == case.refs[2]
    # a follow-up prompt extending the cached conversation reuses the whole cached prefix, bounded caches included
    follow = PROMPTS[2] + case.refs[2] + PROMPTS[0]
    fresh = generate(torch_engine(case.model), follow, max_new_tokens=16).tokens
    resets, reset = [], oracle.reset
    oracle.reset = lambda: (resets.append(1), reset())
    oracle.reference = follow + fresh
    assert generate(oracle, follow, max_new_tokens=16).tokens == fresh
    assert not resets  # at most the last verify's extra positions were rewound: no re-prefill


# hybrid and gpt-oss targets take 30-55 s each on MLX on a Linux CPU (mlx[cpu]'s BLAS); their torch side runs in the
# default run (test_torch_greedy_lossless, the rewind tests), the MLX side in .ci/run (-m slow)
MLX_SLOW = {"qwen3_5", "qwen3_5_moe", "gpt_oss"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in MLX_SLOW else f for f in FAMILIES])
def test_mlx_lossless_and_cross_backend(cases, family):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from dflash.backends import mlx as mlx_backend

    case = cases(family, "_truncated", rope_parameters=YARN_TRUNCATED) if family == "gpt_oss" else cases(family)
    load = dict(dtype="float32", device="cpu")
    mlx_refs = [generate(mlx_backend.load(case.mlx_dir, **load), p, max_new_tokens=N).tokens for p in PROMPTS]
    assert mlx_refs == case.refs  # the target-only outputs agree across libraries
    drafted = mlx_backend.load(case.mlx_dir, case.draft_dir, block_size=B, **load)
    check_lossless(drafted, mlx_refs, oracle=False)
    oracle = with_oracle(mlx_backend.load(case.mlx_dir, case.draft_dir, block_size=B, **load))
    check_lossless(oracle, mlx_refs, oracle=True)
    chunked = mlx_backend.load(case.mlx_dir, case.draft_dir, block_size=B, prefill_chunk=7, **load)
    assert generate(chunked, PROMPTS[2], max_new_tokens=N).tokens == mlx_refs[2]
    # torch vs MLX: identical tokens and every cycle's proposals (an untrained drafter turns any feature difference
    # into different proposals at once)
    tb = torch_engine(case.model, load_drafter(case.draft_dir), block_size=B)
    for p in PROMPTS:
        a = generate(tb, p, max_new_tokens=N, trace=True)
        b = generate(drafted, p, max_new_tokens=N, trace=True)
        assert a.tokens == b.tokens and a.drafted == b.drafted


def test_gpt_oss_yarn_difference_is_measured(cases):
    """transformers applies gpt-oss's `truncate: false` YaRN; mlx-lm's YarnRoPE always truncates the correction
    range. Position 0 (no rotation) agrees to float32 rounding; later positions differ by a small, bounded amount
    that grows with distance. (With `truncate: true` the two are identical: test_mlx_lossless_and_cross_backend.)"""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np

    from dflash.backends.mlx.target import load_target as load_mlx_target

    case = cases("gpt_oss")
    ids = PROMPTS[2]
    with torch.no_grad():
        ours = case.model(input_ids=torch.tensor([ids])).logits[0].numpy()
    mlx_model, _ = load_mlx_target(case.mlx_dir, mx.float32)
    theirs = np.array(mlx_model(mx.array([ids], dtype=mx.int32))[0])
    diff = np.abs(ours - theirs).max(-1)
    assert diff[0] < 1e-6
    assert 1e-6 < diff.max() < 1e-3, f"max |logit difference| {diff.max():.2e}"
    exact = cases("gpt_oss", "_truncated", rope_parameters=YARN_TRUNCATED)
    with torch.no_grad():
        ours = exact.model(input_ids=torch.tensor([ids])).logits[0].numpy()
    theirs = np.array(load_mlx_target(exact.mlx_dir, mx.float32)[0](mx.array([ids], dtype=mx.int32))[0])
    assert np.abs(ours - theirs).max() < 1e-5


# ---- rollback of hybrid (linear-attention) state -------------------------------------------------------------------
def _verify_block(backend, block):
    return backend.verify(Draft(backend.target.ids([block])))


@pytest.mark.parametrize("family", HYBRID)
def test_torch_rollback_equals_feeding_only_the_accepted_tokens(cases, family):
    from transformers import DynamicCache

    case = cases(family)
    model, prompt, block = case.model, PROMPTS[1], case.refs[1][:B]
    block[3] = block[3] % 490 + 6
    for keep in (1, 3, B - 1):
        be = torch_engine(model, load_drafter(case.draft_dir), block_size=B)
        be.prefill([prompt])
        be.commit(_verify_block(be, block), [keep])
        assert int(be.target.cache.get_seq_length()) == len(prompt) + keep  # (the next forward's positions)
        fresh = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]), cache=fresh, use_cache=True)
            model(input_ids=torch.tensor([block[:keep]]), cache=fresh, use_cache=True)
        linear = [i for i, layer in enumerate(fresh.layers) if hasattr(layer, "conv_states")]
        assert linear and len(linear) < len(fresh.layers)
        for i, (ours, ref) in enumerate(zip(be.target.cache.layers, fresh.layers)):
            if i in linear:
                torch.testing.assert_close(ours.conv_states[0], ref.conv_states[0], rtol=0, atol=1e-6)
                torch.testing.assert_close(ours.recurrent_states[0], ref.recurrent_states[0], rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(ours.keys, ref.keys, rtol=1e-4, atol=1e-5)
    # the control: the recurrent state the verify forward left (all B positions: what rolling back only the conv
    # windows and K/V leaves behind) is measurably not that of the 3 kept
    be = torch_engine(model, load_drafter(case.draft_dir), block_size=B)
    be.prefill([prompt])
    _verify_block(be, block)
    state = be.target.cache.layers[linear[0]].recurrent_states[0]
    be2 = torch_engine(model, load_drafter(case.draft_dir), block_size=B)
    be2.prefill([prompt])
    be2.commit(_verify_block(be2, block), [3])
    assert (state - be2.target.cache.layers[linear[0]].recurrent_states[0]).abs().max() > 1e-3


def test_torch_rollback_cost(cases, record_property):
    """The rollback (recurrence over the kept positions, per linear layer) next to the verify forward it follows
    (the ratio goes to the test report's properties, e.g. --junitxml, not into the test output)."""
    case = cases("qwen3_5")
    be = torch_engine(case.model, load_drafter(case.draft_dir), block_size=B)
    be.prefill([PROMPTS[2]])
    block = [5] * B
    verify, rewind = [], []
    for _ in range(15):
        t0 = time.perf_counter()
        with torch.inference_mode():
            be.target.forward(torch.tensor([block]), last_only=False)
        t1 = time.perf_counter()
        with torch.inference_mode():
            assert be.target.rewind.rewind(1)  # keep B-1 of the B positions: the most recurrence work a commit needs
        t2 = time.perf_counter()
        assert be.target.rewind.rewind(B - 1)  # back to before the block
        assert int(be.target.cache.get_seq_length()) == len(PROMPTS[2])
        verify.append(t1 - t0)
        rewind.append(t2 - t1)
    ratio = sorted(rewind)[7] / sorted(verify)[7]
    record_property("rollback_over_verify_forward", round(ratio, 3))
    assert ratio < 1.0, f"[qwen3_5 tiny, B={B}] rollback / verify forward = {ratio:.2f}"


@pytest.mark.parametrize("family", HYBRID + ["gpt_oss"])
def test_mlx_rollback_equals_feeding_only_the_accepted_tokens(cases, family):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

    from dflash.backends import mlx as mlx_backend

    case = cases(family)
    prompt = PROMPTS[2] + case.refs[2][:4]  # past gpt-oss's window (16): the rotating caches have wrapped
    block = case.refs[2][4:4 + B]
    block[3] = block[3] % 490 + 6
    for keep in (1, 3, B - 1):
        be = mlx_backend.load(case.mlx_dir, case.draft_dir, block_size=B, dtype="float32", device="cpu")
        be.prefill([prompt])
        be.commit(be.verify(Draft(be.target.ids([block]))), [keep])
        model = be.target.model
        fresh = make_prompt_cache(model)
        model(mx.array([prompt], dtype=mx.int32), cache=fresh)
        model(mx.array([block[:keep]], dtype=mx.int32), cache=fresh)
        for ours, ref in zip(be.target.cache, fresh):
            if isinstance(ref, ArraysCache):
                for a, b in zip(ours.cache, ref.cache):
                    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
            elif isinstance(ref, RotatingKVCache):
                assert ours.offset == ref.offset  # (the rings' layouts may differ: read through the next forward below)
            else:
                assert ours.offset == ref.offset
                np.testing.assert_allclose(np.array(ours.keys[..., :ours.offset, :]),
                                           np.array(ref.keys[..., :ref.offset, :]), rtol=1e-4, atol=1e-5)
        # what attention reads from every cache, the rotating ones as well (a k-token forward wraps a ring like a
        # B-token one, so their slots may be laid out differently): the next token's logits agree
        following = mx.array([[block[keep]]], dtype=mx.int32)
        np.testing.assert_allclose(np.array(model(following, cache=be.target.cache)),
                                   np.array(model(following, cache=fresh)), rtol=1e-4, atol=1e-4)


# ---- drafters with sliding-window layers ---------------------------------------------------------------------------
def reference_draft(drafter, block, feats):
    """The drafter over its whole context with z-lab's attention rule written out as a dense mask (their torch and
    MLX reference drafters): in a `sliding_attention` layer (window S) block slot j at position p_j sees the keys at
    positions p with p_j - p < S, and no later slot when the layer is causal (sliding layers unless `is_causal` is set;
    non-causal sliding layers also need p - p_j < S); full-attention layers see everything."""
    import torch.nn.functional as F

    spec = drafter.spec
    n, bsz = feats.shape[1], block.shape[1]
    rope_kv = drafter.rope(torch.arange(n + bsz), block)
    rope_q = (rope_kv[0][:, :, n:], rope_kv[1][:, :, n:])
    q_pos, k_pos = torch.arange(n, n + bsz)[:, None], torch.arange(n + bsz)[None, :]

    def attend(i, q, k, v):
        visible = torch.ones(bsz, n + bsz, dtype=torch.bool)
        window, causal = spec.window_for_layer(i), spec.causal_for_layer(i)
        if causal:
            visible &= k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
            if not causal:
                visible &= k_pos - q_pos < window
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

    with torch.no_grad():
        return drafter(block, drafter.project_context(feats), rope_q, rope_kv, attend)


def test_sliding_window_drafter_is_honoured(cases, tmp_path):
    """Drafters whose config declares `sliding_attention` layers (window 8, context 30) compute exactly the reference
    rule through the cached path on both backends, differ from the same weights run as full attention, and decode
    losslessly; the MLX drafter proposes the same tokens as the torch one."""
    case = cases("qwen3")
    full = tiny.draft_spec_for(case.target_dir, num_layers=2, block_size=B)
    specs = {
        "full": full,
        "sliding": dataclasses.replace(full, layer_types=["sliding_attention"] * 2, sliding_window=8),
        "mixed": dataclasses.replace(full, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
        "bidirectional": dataclasses.replace(full, layer_types=["sliding_attention"] * 2, sliding_window=8,
                                             extra={"is_causal": False}),
    }
    torch.manual_seed(3)
    drafters = {"full": DFlashDrafter(full).eval()}
    for name, spec in specs.items():
        if name != "full":
            drafters[name] = DFlashDrafter(spec).eval()
            drafters[name].load_state_dict(drafters["full"].state_dict())
    feats = torch.randn(1, 30, full.hidden_size * full.num_context_layers)
    block = torch.randn(1, B, full.hidden_size)

    def step(name):
        with torch.no_grad():
            cache = DraftContextCache(specs[name], torch.float32, "cpu")
            return draft_step(drafters[name], block, feats, [feats.shape[1]], cache)

    for name in specs:
        torch.testing.assert_close(step(name), reference_draft(drafters[name], block, feats), rtol=1e-5, atol=1e-5)
    for a, b in [("sliding", "full"), ("mixed", "full"), ("mixed", "sliding"), ("bidirectional", "sliding")]:
        assert (step(a) - step(b)).abs().max() > 1e-3, (a, b)

    save_drafter(drafters["mixed"], tmp_path / "mixed")
    torch_be = torch_engine(case.model, load_drafter(tmp_path / "mixed"), block_size=B)
    assert torch_be.drafter.cache.rules == [LayerRule(8, True), LayerRule(None, False)]
    traces = [generate(torch_be, p, max_new_tokens=N, trace=True) for p in PROMPTS]
    assert [t.tokens for t in traces] == case.refs
    pytest.importorskip("mlx_lm")
    from dflash.backends import mlx as mlx_backend

    mlx_be = mlx_backend.load(case.mlx_dir, tmp_path / "mixed", block_size=B, dtype="float32", device="cpu")
    assert mlx_be.drafter.cache.rules == [LayerRule(8, True), LayerRule(None, False)]
    for p, t in zip(PROMPTS, traces):
        r = generate(mlx_be, p, max_new_tokens=N, trace=True)
        assert r.tokens == t.tokens and r.drafted == t.drafted  # the MLX drafter windows the same way
