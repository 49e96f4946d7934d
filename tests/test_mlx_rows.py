"""Rows on MLX (backends/mlx/target_runner.py on dflash.core.rows.RowLayout): a batch on mlx-lm's KVCache gives every row its
batch-1 greedy output, with holes and compaction, trees for several rows, greedy rows beside sampled ones; and the
torch and MLX batches agree token for token in float32 (kept prefixes on both: tests/test_prefix_cache.py)."""

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash import backends  # noqa: E402
from dflash.core import rows  # noqa: E402
from dflash.core.loop import Batch, Generation, generate, generate_batch  # noqa: E402
from dflash.core.rows import RowLayout  # noqa: E402
from dflash.core.sampling import SamplingParams  # noqa: E402


def load(pair, backend="mlx", **kw):
    return backends.get(backend).load(*pair, dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def mixed_prompts(prompts):
    return [p[: 4 + 3 * i] for i, p in enumerate(prompts[:6])]  # 4 .. 19 tokens: real left padding


@pytest.fixture(scope="module")
def alone(trained_pair, mixed_prompts):
    engine = load(trained_pair)
    return [generate(engine, p, max_new_tokens=64).tokens for p in mixed_prompts]


def test_every_row_equals_its_batch1_output(trained_pair, mixed_prompts, alone, monkeypatch):
    compactions = []
    monkeypatch.setattr(RowLayout, "compacted",
                        lambda self, index, orig=RowLayout.compacted: (compactions.append(1), orig(self, index)))
    monkeypatch.setattr(rows, "COMPACT_SHRINK", 0.1)  # compaction happens whatever the acceptances were
    got = generate_batch(load(trained_pair), mixed_prompts, max_new_tokens=64)
    assert [g.tokens for g in got] == alone
    taus = [g.mean_acceptance_length for g in got]
    assert max(taus) > 2 and max(taus) > min(taus), taus  # rows accepted different prefixes: holes were made
    assert compactions, "the batch never compacted its caches"


def test_trees_for_several_rows(trained_pair, mixed_prompts, alone):
    engine = load(trained_pair)
    engine.set_verify("tree", budget=24)
    got = generate_batch(engine, mixed_prompts[:4], max_new_tokens=64)
    assert [g.tokens for g in got] == alone[:4]


def test_a_greedy_row_beside_sampled_rows_stays_greedy(trained_pair, mixed_prompts, alone):
    engine = load(trained_pair)
    batch = Batch(engine)
    sampled = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2)]
    gens = [Generation(engine, mixed_prompts[0], max_new_tokens=64)]
    gens += [Generation(engine, p, max_new_tokens=64, sampling=s) for p, s in zip(mixed_prompts[1:3], sampled)]
    for g in gens:
        batch.join(g)
    while batch:
        batch.step()
    assert gens[0].result.tokens == alone[0]
    assert all(len(g.result.tokens) == 64 for g in gens)


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_torch_and_mlx_batches_agree(trained_pair, mixed_prompts, verify):
    outputs = []
    for name in ("torch", "mlx"):
        engine = load(trained_pair, name)
        if verify == "tree":
            engine.set_verify("tree", budget=24)
        got = generate_batch(engine, mixed_prompts, max_new_tokens=48, trace=True)
        outputs.append([(g.tokens, g.acceptance_lengths) for g in got])
    assert outputs[0] == outputs[1]


def test_a_kept_row_holds_only_its_own_buffers(trained_pair, mixed_prompts):
    """A row kept after it leaves (the prefix cache) gets buffers of its own: a lazy slice of the batch's caches
    would pin every row's K/V for as long as the prefix is kept (a server's memory grew by 1.4 GB in 3 minutes)."""
    import gc

    import mlx.core as mx

    engine = load(trained_pair)
    batch = Batch(engine)
    for p in mixed_prompts:
        batch.join(Generation(engine, p, max_new_tokens=64))
    for _ in range(3):  # the rows share the target's and drafter's caches
        batch.step()
    target, drafter = engine.target.extract(2), engine.drafter.extract(2)
    kept = target.cache_bytes() + drafter.cache_bytes()
    engine.target.reset()
    engine.drafter.reset()
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory()
    del target, drafter
    gc.collect()
    assert held - mx.get_active_memory() <= 2 * kept  # (without copies: 80 times more)


def test_rows_out_of_the_draft_forward_keep_their_batch1_output(trained_pair, mixed_prompts, alone, monkeypatch):
    """MLX's draft of some rows (a different third of the rows out of every draft forward, under --verify auto):
    every row's greedy output is its batch-1 output, and a draft of some rows proposes what the whole batch's does."""
    from dflash.core import budget
    from cycle_devices import FixedTimes

    engines = [load(trained_pair) for _ in range(2)]
    anchors = [e.prefill(mixed_prompts[:4]) for e in engines][0]
    whole, some = engines[0].draft(anchors, top_k=4), engines[1].draft(anchors, top_k=4, rows=[1, 3])
    assert some.ids.tolist() == [whole.ids.tolist()[r] for r in (1, 3)]
    assert engines[1].drafter.cache.lengths == engines[0].drafter.cache.lengths
    cycles = []

    def drafting(planner, pauses):
        cycles.append(len(pauses))
        return [r for r in range(len(pauses)) if (r + len(cycles)) % 3]

    monkeypatch.setattr(budget.TreePlanner, "drafting_rows", drafting)
    engine = load(trained_pair)
    engine.set_verify("auto", times=FixedTimes(plain=1.0, token=0.3 / 511, draft=0.3))
    engine.policy.planner.path = lambda *_: "tree"
    got = generate_batch(engine, mixed_prompts, max_new_tokens=64)
    assert [g.tokens for g in got] == alone and len(cycles) >= 4
