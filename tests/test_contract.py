"""The backend contract (dflash/core/contract.py), checked the same way on every backend: the numpy fakes, torch and
MLX. Each step of a cycle returns a value (draft -> Draft, verify -> Verified, commit(verified, keeps)), the caches
follow the committed tokens, greedy output is the target's own, and what a backend declares in its capabilities
(batches, trees) is what it does."""

import inspect

import pytest
from fakes import FakeDrafter, FakeTarget

from dflash.core.contract import Capabilities, Draft, Drafter, Target, Verified
from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.loop import generate, generate_batch
from dflash.core.sampling import RowSampling, SamplingParams

B = 4
N = 12


def members(protocol) -> set[str]:
    own = {n for n, v in vars(protocol).items() if inspect.isfunction(v) or isinstance(v, property)}
    return own | set(getattr(protocol, "__annotations__", {}))


ROW_MEMBERS = {"spawn", "merge", "select", "extract", "cache_bytes", "take_rows", "pad_rows"}  # capabilities.batches
TREE_MEMBERS = {"keep_slots", "gather"}  # capabilities.trees


@pytest.fixture(scope="module", params=["numpy", "torch", "mlx"])
def backend(request, tiny_target_dir, random_draft_dir, prompts):
    """(make(drafter: bool) -> Engine, two prompts)"""
    if request.param == "numpy":
        def make(drafter=True):
            return Engine(FakeTarget(), FakeDrafter(good=2) if drafter else None, block_size=B)

        return make, [[1, 2, 3], [5, 6, 7, 8, 9]]
    if request.param == "torch":
        from dflash.backends.torch import load
    else:
        pytest.importorskip("mlx_lm")
        from dflash.backends.mlx import load

    def make(drafter=True):
        return load(tiny_target_dir, random_draft_dir if drafter else None, block_size=B, dtype="float32",
                    device="cpu")

    return make, [p[:12] for p in prompts[:2]]


def test_primitives_have_every_member_of_the_contract(backend):
    make, _ = backend
    engine = make()
    caps = engine.capabilities
    assert isinstance(caps, Capabilities)
    optional = (set() if caps.batches else ROW_MEMBERS) | (set() if caps.trees else TREE_MEMBERS)
    for primitive, protocol in ((engine.target, Target), (engine.drafter, Drafter)):
        missing = sorted(m for m in members(protocol) - optional if not hasattr(primitive, m))
        assert not missing, f"{type(primitive).__name__} lacks {missing}"


def test_a_cycle_hands_values_from_step_to_step(backend):
    make, prompts = backend
    engine = make()
    (first,) = engine.prefill([prompts[0]])
    draft = engine.draft([first])
    assert isinstance(draft, Draft)
    block = engine.target.to_host(draft.ids)
    assert len(block) == 1 and len(block[0]) == B and block[0][0] == first
    verified = engine.verify(draft)
    assert isinstance(verified, Verified)
    assert verified.blocks == block and len(verified.tokens[0]) == B and verified.proposals == [block[0][1:]]
    keep = next((i for i, (d, t) in enumerate(zip(verified.proposals[0], verified.tokens[0])) if d != t), B - 1) + 1
    before = list(engine.tokens)
    engine.commit(verified, [keep])
    assert engine.tokens == before + block[0][:keep]
    assert engine.drafter.position + engine.pending.counts[0] == len(engine.tokens)  # the drafter's context follows


def test_greedy_output_is_the_targets_own(backend):
    make, prompts = backend
    plain, speculative = make(drafter=False), make()
    for p in prompts:
        assert generate(speculative, p, max_new_tokens=N).tokens == generate(plain, p, max_new_tokens=N).tokens


def test_each_step_brings_every_rows_settings(backend):
    """A target holds no per-row sampling settings: Target.sample draws row i under rows[i], the settings passed with
    the step, whatever it drew under before and in either row order."""
    make, prompts = backend
    engine = make(drafter=False)
    target = engine.target
    (first,) = engine.prefill([prompts[0]])
    logits, _ = target.forward(target.ids([[first]]), last_only=False)
    two, histories = target.take_rows(logits, [0, 0]), [list(engine.tokens)] * 2

    def sample(*rows):
        return [row[0] for row in target.to_host(target.sample(two, histories, None, rows))]

    greedy = RowSampling.admit(SamplingParams())
    (plain, _) = sample(greedy, greedy)
    bias = (plain + 1) % logits.shape[-1]
    biased = RowSampling.admit(SamplingParams(logit_bias=((bias, 100.0),)))
    assert sample(greedy, biased) == [plain, bias]
    assert sample(biased, greedy) == [bias, plain]
    assert sample(greedy, greedy) == [plain, plain]


def test_crop_rewinds_to_any_committed_length(backend):
    make, prompts = backend
    engine, fresh = make(), make()
    p = prompts[1]
    out = generate(engine, p, max_new_tokens=N).tokens
    follow = p + out[:3] + [out[0]]  # shares the prompt and three generated tokens, then diverges
    assert generate(engine, follow, max_new_tokens=N).tokens == generate(fresh, follow, max_new_tokens=N).tokens
    engine.crop(len(p) - 2)
    assert len(engine.tokens) in (len(p) - 2, 0)  # 0: a cache that cannot go back that far started over
    assert generate(engine, p, max_new_tokens=N).tokens == out


def test_capabilities_say_what_the_backend_does(backend):
    make, prompts = backend
    engine = make()
    caps = engine.capabilities
    if caps.batches:
        singles = [generate(make(), p, max_new_tokens=N).tokens for p in prompts]
        assert [r.tokens for r in generate_batch(engine, prompts, max_new_tokens=N)] == singles
    else:
        with pytest.raises(DFlashError, match=caps.batch_refusal.split(":")[0]):
            engine.target.spawn()
    if caps.trees:
        plain = generate(make(drafter=False), prompts[0], max_new_tokens=N).tokens
        engine.set_verify("tree", budget=B)
        assert generate(engine, prompts[0], max_new_tokens=N).tokens == plain
    else:
        with pytest.raises(DFlashError, match="--verify tree"):
            engine.set_verify("tree", budget=B)
