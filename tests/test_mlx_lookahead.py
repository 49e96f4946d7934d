"""Plain decoding on MLX runs one step ahead of the host (dflash/core/lookahead.py, MLXTarget.start): greedy output is
mlx-lm's own generate_step's, sampled and penalised rows draw what steps run in turn draw, rows of a batch their
batch-1 output, and a stop (EOS, a stop string) leaves mlx-lm's cache at the committed tokens, so the next request
on the same engine is a fresh engine's."""

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from fakes import Counting  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from dflash.backends.mlx.backend import mlx_engine  # noqa: E402
from dflash.backends.mlx.target import load_target  # noqa: E402
from dflash.core.loop import Generation, generate, generate_batch  # noqa: E402
from dflash.core.model_files.tokenizer import load_tokenizer  # noqa: E402
from dflash.core.sampling import SamplingParams  # noqa: E402

N = 40


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, mx.float32)


@pytest.fixture(scope="module")
def few(prompts):
    return [p[:12 + 5 * i] for i, p in enumerate(prompts[:3])]


def in_turn(engine):
    """The engine with its target's `start` hidden: its plain steps run in turn, each read before the next."""
    engine.target = Counting(engine.target, hidden=["start"])
    return engine


def offset(engine):
    return engine.target.cache[0].offset


def test_greedy_output_is_mlx_lm_generate_steps(target, few):
    engine = mlx_engine(*target)
    for p in few:
        want = [t for t, _ in generate_step(mx.array(p), target[0], max_tokens=N)]
        assert generate(engine, p, max_new_tokens=N).tokens == want
        assert offset(engine) == len(engine.tokens)  # (the last token is not fed: nothing ahead is left)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=50, seed=3),
                                    SamplingParams(repetition_penalty=1.5),  # greedy over the whole history
                                    SamplingParams(temperature=0.7, presence_penalty=1.5, seed=5)])
def test_sampled_and_penalised_rows_draw_what_steps_in_turn_draw(target, few, params):
    ahead = generate_batch(mlx_engine(*target), few, max_new_tokens=N, sampling=params)
    serial = generate_batch(in_turn(mlx_engine(*target)), few, max_new_tokens=N, sampling=params)
    assert [r.tokens for r in ahead] == [r.tokens for r in serial]
    alone = generate(mlx_engine(*target), few[0], max_new_tokens=N, sampling=params)
    assert alone.tokens == ahead[0].tokens  # (row 0 draws generate()'s seed)


def test_an_early_eos_leaves_the_cache_at_the_committed_tokens(target, few):
    engine = mlx_engine(*target)
    ref = generate(mlx_engine(*target), few[0], max_new_tokens=N).tokens
    eos = ref[5]
    r = generate(engine, few[0], max_new_tokens=N, eos_token_ids=[eos])
    assert r.tokens == ref[: ref.index(eos) + 1] and r.finish_reason == "stop"
    assert offset(engine) == len(engine.tokens)
    follow = few[0] + r.tokens + few[1][:3]  # a chat's next turn reuses the cached prefix
    again = generate(engine, follow, max_new_tokens=N)
    assert engine.last_reused == len(few[0]) + len(r.tokens) - 1  # (the EOS itself was never fed)
    assert again.tokens == generate(mlx_engine(*target), follow, max_new_tokens=N).tokens


def test_a_stop_string_mid_stream_and_the_next_request(target, tiny_target_dir, few):
    tokenizer = load_tokenizer(tiny_target_dir)
    engine = mlx_engine(*target)
    ref = generate(mlx_engine(*target), few[1], max_new_tokens=N, tokenizer=tokenizer)
    stop = ref.text[len(ref.text) // 2:][:3]
    gen = Generation(engine, few[1], tokenizer=tokenizer, max_new_tokens=N, stop_strings=[stop])
    streamed = "".join(inc.text for inc in gen)
    r = gen.result
    assert r.finish_reason == "stop" and streamed == r.text == ref.text[: ref.text.index(stop)]
    assert r.tokens == ref.tokens[: len(r.tokens)] and len(r.tokens) < N
    assert offset(engine) == len(engine.tokens)
    assert generate(engine, few[2], max_new_tokens=N).tokens == generate(mlx_engine(*target), few[2],
                                                                          max_new_tokens=N).tokens


def test_batch_rows_are_batch_1s_with_rows_stopping_early(target, few):
    alone = [generate(mlx_engine(*target), p, max_new_tokens=N).tokens for p in few]
    eos = alone[1][4]  # row 1 (at least) stops early; the rest run on
    cut = [a[: a.index(eos) + 1] if eos in a else a for a in alone]
    got = generate_batch(mlx_engine(*target), few, max_new_tokens=N, eos_token_ids=[eos])
    assert [g.tokens for g in got] == cut and len(got[1].tokens) < N
