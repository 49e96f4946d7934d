"""MLX backend: lossless greedy decoding against its own --no-draft run, every acceptance length, layer taps that
leave the shared model untouched, quantized targets and drafters, sampling, the generate CLI."""

import json
import subprocess
import sys

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from fakes import Counting, OracleDrafter  # noqa: E402
from paused import ScriptedPauses, check_paused_cycles  # noqa: E402

from dflash.backends.mlx import load  # noqa: E402
from dflash.backends.mlx.backend import mlx_engine  # noqa: E402
from dflash.backends.mlx.drafter import load_drafter  # noqa: E402
from dflash.backends.mlx.target import decoder_layers, embedding, load_target  # noqa: E402
from cycle_devices import FixedTimes  # noqa: E402
from dflash.core.errors import DFlashError  # noqa: E402
from dflash.core.loop import generate  # noqa: E402
from dflash.core.sampling import SamplingParams  # noqa: E402
from dflash.core.policy import Policy  # noqa: E402

N = 48  # new tokens per prompt


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, mx.float32)


@pytest.fixture(scope="module")
def few(prompts):
    return prompts[:4]


@pytest.fixture(scope="module")
def baseline(target, few):
    ar = mlx_engine(*target)
    return [generate(ar, p, max_new_tokens=N + 16).tokens for p in few]


def save_random_drafter(directory, target_dir, seed=1, **spec):
    import torch

    from dflash.backends.torch.drafter import DFlashDrafter, save_drafter
    from dflash.reference import tiny

    torch.manual_seed(seed)
    save_drafter(DFlashDrafter(tiny.draft_spec_for(target_dir, **spec)), directory)
    return directory


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_lossless(target, random_draft_dir, few, baseline, block_size):
    backend = mlx_engine(*target, load_drafter(random_draft_dir), block_size=block_size)
    for p, ref in zip(few, baseline):
        r = generate(backend, p, max_new_tokens=N, trace=True)  # one backend for all prompts: caches are cropped
        assert r.tokens == ref[:N]
        assert all(len(d) == block_size - 1 for d in r.drafted)


def test_a_paused_cycle_is_the_plain_step(target, random_draft_dir, few):
    check_paused_cycles(mlx_engine(*target, load_drafter(random_draft_dir), block_size=16), mlx_engine(*target), few[0])


def test_a_probe_that_plans_no_node_takes_the_step_issued_ahead(target, random_draft_dir, few, baseline):
    """--verify auto without the copied branch where a draft forward costs four plain steps: every probe plans no
    node. The paused cycle before a probe has issued the next plain step; the probe drafts beside it, takes it and
    issues the one after, so a probe that is not taken makes the target run nothing a plain step does not."""
    backend = mlx_engine(*target, load_drafter(random_draft_dir), block_size=16)
    backend.set_verify("auto", None, FixedTimes(plain=1.0, token=0.04, draft=4.0), copy_branch=False)
    first = backend.prefill([few[0]])
    out = first + backend.step(first)[0].tokens  # (the request's first cycle probes)
    backend.target, anchor, probes = Counting(backend.target), out[-1], 0
    for _ in range(40):
        ahead, forwards = backend.lookahead.anchors, backend.target.calls["forward"]
        step = backend.step([anchor])[0]
        if step.draft_forward:
            probes += 1
            assert ahead == [anchor] and backend.target.calls["forward"] == forwards + 1  # (the next step's only)
            assert backend.lookahead.anchors == [step.tokens[-1]]
        out, anchor = out + step.tokens, step.tokens[-1]
    assert probes >= 3 and out == baseline[0][: len(out)]


def with_oracle(backend, truth, prompt_len):
    """Runs the real drafter, then replaces its proposals by the known continuation with slot `k` made wrong, k
    cycling through 0..B-1 (B-1: nothing wrong): every acceptance length 1..B is committed in turn."""
    cycles = iter(range(10**6))

    def proposals(row, anchor):
        b = backend.block_size
        done = len(backend.tokens) - prompt_len  # generated tokens before the anchor (anchor = truth[done])
        props = list(truth[done + 1:done + b])
        wrong = next(cycles) % b
        if wrong < b - 1:
            props[wrong] = (props[wrong] + 1) % backend.info.vocab_size
        return props

    backend.drafter = OracleDrafter(backend.drafter, backend.target, proposals)
    return backend


def test_a_seeded_request_paused_and_run_ahead_draws_the_plain_engines_tokens(target, random_draft_dir, few):
    """Sampled rows of a drafter that is never right, paused as --verify auto pauses them: the paused cycles run their
    plain step one ahead; a seeded request's draws are keyed by position, so its tokens are the drafter-less
    engine's."""
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=7)
    plain = generate(mlx_engine(*target), few[0], max_new_tokens=100, sampling=params).tokens
    backend = mlx_engine(*target, load_drafter(random_draft_dir), block_size=16)
    backend.policy = Policy(chain_budget=ScriptedPauses(16))
    backend.target = Counting(backend.target)
    r = generate(backend, few[0], max_new_tokens=100, sampling=params)
    assert r.tokens == plain and r.accept_rule == "match"
    assert r.cycles_without_draft > 60 and backend.target.calls["start"] > 50


def test_every_acceptance_length_is_exact(target, random_draft_dir, few, baseline):
    for p, ref in zip(few[:2], baseline):
        backend = with_oracle(mlx_engine(*target, load_drafter(random_draft_dir), block_size=8), ref, len(p))
        r = generate(backend, p, max_new_tokens=N)
        assert r.tokens == ref[:N]
        assert set(r.acceptance_lengths[:8]) == set(range(1, 9))
        # the drafter's context tracks exactly the committed positions
        assert backend.drafter.position + backend.pending.counts[0] == len(backend.tokens)


def test_repetition_penalty_rows_see_their_own_history(target, random_draft_dir, few):
    """Greedy + repetition penalty: row i of a verified block is penalised with history + block[:i+1]."""
    params = SamplingParams(repetition_penalty=1.5)
    p = few[0]
    ref = generate(mlx_engine(*target), p, max_new_tokens=N + 16, sampling=params).tokens
    backend = with_oracle(mlx_engine(*target, load_drafter(random_draft_dir), block_size=8), ref, len(p))
    r = generate(backend, p, max_new_tokens=N, sampling=params)
    assert r.tokens == ref[:N]
    assert max(r.acceptance_lengths) == 8


def test_two_drafters_with_different_layers_share_one_model(tmp_path, tiny_target_dir, target, few, baseline):
    model, config = target
    layers = list(decoder_layers(model))
    a = load_drafter(save_random_drafter(tmp_path / "a", tiny_target_dir, num_layers=2, target_layer_ids=[0, 2]))
    b = load_drafter(save_random_drafter(tmp_path / "b", tiny_target_dir, seed=2, num_layers=2,
                                         target_layer_ids=[1, 3]))
    ba, bb = mlx_engine(model, config, a), mlx_engine(model, config, b)
    for backend in (ba, bb, ba):
        assert generate(backend, few[0], max_new_tokens=32).tokens == baseline[0][:32]
    assert all(x is y for x, y in zip(decoder_layers(model), layers))  # no tap left behind

    # the features are the outputs of decoder layers [0, 2] and [1, 3] (HF hidden_states[i + 1])
    ids = mx.array([few[1]], dtype=mx.int32)
    h, outs = embedding(model)(ids), []
    for layer in decoder_layers(model):
        h = layer(h, "causal", None)
        outs.append(h)
    for backend, want in ((ba, [0, 2]), (bb, [1, 3])):
        _, feats = backend.target.runner(ids, make_prompt_cache(model), last_only=True)
        ref = mx.concatenate([outs[i] for i in want], axis=-1)
        assert mx.allclose(feats, ref, atol=1e-5).item()


def test_quantized_target_loads_and_runs(tmp_path, tiny_target_dir, random_draft_dir, few):
    from dflash.converters.target import target_to_mlx

    q = target_to_mlx(tiny_target_dir, tmp_path / "q4", quantize=True, bits=4, group_size=64, quiet=True)
    backend = load(q, random_draft_dir)
    assert type(backend.drafter.embed).__name__ == "QuantizedEmbedding"
    ref = generate(load(q), few[0], max_new_tokens=32).tokens
    assert generate(backend, few[0], max_new_tokens=32).tokens == ref


def test_quantized_drafter_loads_and_is_lossless(tmp_path, target, random_draft_dir, few, baseline):
    from dflash.converters.quantize import quantize_drafter

    q = quantize_drafter(random_draft_dir, tmp_path / "dq8", bits=8, group_size=64)
    drafter = load_drafter(q)
    assert type(drafter.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert generate(mlx_engine(*target, drafter), few[0], max_new_tokens=32).tokens == baseline[0][:32]


def test_seeded_sampling_is_reproducible(target, random_draft_dir, few):
    backend = mlx_engine(*target, load_drafter(random_draft_dir))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    one = generate(backend, few[0], max_new_tokens=24, sampling=params).tokens
    assert generate(backend, few[0], max_new_tokens=24, sampling=params).tokens == one
    other = generate(backend, few[0], max_new_tokens=24, sampling=SamplingParams(temperature=0.8, seed=4)).tokens
    assert other != one


def test_chunked_prefill_prefix_reuse_and_window(target, random_draft_dir, prompts):
    long = sum(prompts[:6], [])
    ref = generate(mlx_engine(*target), long, max_new_tokens=56).tokens
    chunked = mlx_engine(*target, load_drafter(random_draft_dir), prefill_chunk=7, draft_window=16)
    assert generate(chunked, long, max_new_tokens=56).tokens == ref
    follow = long + ref + prompts[7]
    fresh = generate(mlx_engine(*target), follow, max_new_tokens=24).tokens
    assert chunked.cached_tokens[:len(long)] == long
    assert generate(chunked, follow, max_new_tokens=24).tokens == fresh


def test_bad_options_fail_with_one_line(tmp_path, tiny_target_dir, random_draft_dir):
    with pytest.raises(DFlashError, match="--block-size"):
        load(tiny_target_dir, random_draft_dir, block_size=17)
    with pytest.raises(DFlashError, match="--device"):
        load(tiny_target_dir, random_draft_dir, device="cuda")
    with pytest.raises(DFlashError, match="--dtype"):
        load(tiny_target_dir, random_draft_dir, dtype="int8")
    cfg = json.loads((random_draft_dir / "config.json").read_text())
    cfg["hidden_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((random_draft_dir / "model.safetensors").read_bytes())
    with pytest.raises(DFlashError, match="hidden_size 32"):
        load(tiny_target_dir, tmp_path)


def test_generate_cli_json(tiny_target_dir, random_draft_dir):
    p = subprocess.run([sys.executable, "-m", "dflash.generate", "--backend", "mlx", "--model", str(tiny_target_dir),
                        "--draft", str(random_draft_dir), "--prompt", "def f(", "--max-new-tokens", "16", "--json",
                        "--trace"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"tokens", "text", "prompt_tokens", "generation_tokens", "acceptance_lengths", "mean_acceptance_length",
            "prefill_seconds", "decode_seconds", "decode_tokens_per_second", "finish_reason", "block_size",
            "drafted"} <= out.keys()
    assert out["generation_tokens"] == len(out["tokens"]) and out["block_size"] == 16
