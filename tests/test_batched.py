"""Batched speculative decoding (the engine with several rows on torch, through dflash.core.loop.generate_batch): every
row's greedy output equals its batch-1 output, rows stop on their own, holes in the caches are compacted without
changing a token."""

import pytest
torch = pytest.importorskip("torch")

from dflash.backends.torch.backend import torch_engine
from dflash.backends.torch.drafter import load_drafter
from dflash.backends.torch.target import load_target
from dflash.core import engine as engine_module
from dflash.core import rows
from dflash.core import budget
from dflash.core.rows import RowLayout
from dflash.core.errors import DFlashError
from dflash.core.loop import Batch, Generation, generate, generate_batch
from dflash.core.sampling import SamplingParams, accepted_length
from dflash.core.cycle import chain_cycle, tree_cycle

from cycle_devices import FixedTimes


@pytest.fixture(scope="module")
def pair(trained_pair):
    target_dir, draft_dir = trained_pair
    target = load_target(target_dir, torch.float32, "cpu")
    return target, load_drafter(draft_dir)


@pytest.fixture(scope="module")
def mixed_prompts(prompts):
    return [p[: 4 + 3 * i] for i, p in enumerate(prompts[:8])]  # 4 .. 25 tokens: real left padding


def batched(target, drafter, block_size=16):
    return torch_engine(target, drafter, block_size=block_size)


def single(target, drafter, block_size=16):
    return torch_engine(target, drafter, block_size=block_size)


@pytest.mark.parametrize("block_size", [8, 16])
def test_every_row_equals_its_batch1_output(pair, mixed_prompts, block_size, monkeypatch):
    target, drafter = pair
    compactions = []
    monkeypatch.setattr(RowLayout, "compacted",
                        lambda self, index, orig=RowLayout.compacted: (compactions.append(1), orig(self, index)))
    monkeypatch.setattr(rows, "COMPACT_SHRINK", 0.1)  # compaction happens whatever the acceptances were
    solo = single(target, drafter, block_size)
    want = [generate(solo, p, max_new_tokens=96) for p in mixed_prompts]
    solo.close()
    be = batched(target, drafter, block_size)
    got = generate_batch(be, mixed_prompts, max_new_tokens=96)
    be.close()
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        assert g.finish_reason == w.finish_reason == "length"
    taus = [g.mean_acceptance_length for g in got]
    assert max(taus) > 2 and max(taus) > min(taus), taus  # rows accept different prefixes: holes were made
    assert compactions, "a long batch never compacted its caches"


def test_rows_stop_on_their_own(pair, mixed_prompts, tiny_target_dir):
    """A frequent token as EOS makes rows finish at different cycles; the retired rows leave the batch and the
    others continue unchanged."""
    from transformers import AutoTokenizer

    target, drafter = pair
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    solo = single(target, drafter)
    first = generate(solo, mixed_prompts[0], max_new_tokens=64).tokens
    eos = {first[len(first) // 3]}  # a token this pair actually produces
    kw = dict(max_new_tokens=64, eos_token_ids=eos, tokenizer=tok)
    want = [generate(solo, p, **kw) for p in mixed_prompts]
    solo.close()
    be = batched(target, drafter)
    got = generate_batch(be, mixed_prompts, **kw)
    be.close()
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    lengths = {len(g.tokens) for g in got}
    assert len(lengths) > 1 and any(g.finish_reason == "stop" for g in got)


def test_autoregressive_batch_and_penalty(pair, mixed_prompts):
    """No drafter (batched baseline) and a logits processor that needs each row's own history."""
    target, _ = pair
    kw = dict(max_new_tokens=40, sampling=SamplingParams(repetition_penalty=1.3))
    want = [generate(single(target, None), p, **kw).tokens for p in mixed_prompts]
    got = generate_batch(batched(target, None), mixed_prompts, **kw)
    assert [g.tokens for g in got] == want
    assert all(a == 1 for g in got for a in g.acceptance_lengths)


def test_sampled_batch_is_well_formed(pair, mixed_prompts):
    target, drafter = pair
    be = batched(target, drafter)
    got = generate_batch(be, mixed_prompts, max_new_tokens=48, sampling=SamplingParams(temperature=1.0, seed=0))
    vocab = target.get_input_embeddings().weight.shape[0]
    same = generate_batch(be, [mixed_prompts[0]] * 3, max_new_tokens=16,
                          sampling=SamplingParams(temperature=1.0, seed=0))
    assert len({tuple(g.tokens) for g in same}) > 1  # one seed, rows still draw independently
    for g in got:
        assert len(g.tokens) == 48 and all(0 <= t < vocab for t in g.tokens)
        # the first token comes from the prefill; the last cycle may commit more than max_new_tokens keeps
        assert sum(g.acceptance_lengths[:-1]) < 47 <= sum(g.acceptance_lengths)


def test_pipeline_batch_and_errors(trained_pair):
    import dflash

    target_dir, draft_dir = trained_pair
    pipe = dflash.load(target_dir, draft_dir, backend="torch", device="cpu")
    texts = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os"]
    got = pipe.generate_batch(texts, max_new_tokens=24)
    assert [g.tokens for g in got] == [pipe.generate(t, max_new_tokens=24).tokens for t in texts]
    assert pipe.generate_batch([]) == []
    with pytest.raises(DFlashError, match="fit the target's context"):
        pipe.generate_batch([[1] * 100_000])


def test_rows_sample_with_their_own_settings(trained_pair):
    """Per-row sampling: a greedy row next to sampled rows keeps its batch-1 tokens, and a seeded sampled row
    draws what it draws alone (each row owns its sampler and generator)."""
    from dflash.core.loop import Batch, Generation

    target, drafter = load_target(trained_pair[0], torch.float32, "cpu"), load_drafter(trained_pair[1])
    prompt = [5, 6, 7, 8, 9]
    settings = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=3),
                SamplingParams(temperature=0.7, top_p=0.9, seed=4), SamplingParams(repetition_penalty=1.3)]
    want = [generate(single(target, drafter), prompt, max_new_tokens=32, sampling=s).tokens for s in settings]
    be = batched(target, drafter)
    batch = Batch(be)
    gens = [Generation(be, prompt, max_new_tokens=32, sampling=s) for s in settings]
    for g in gens:
        batch.join(g)
        batch.step()  # rows join a running batch, one cycle apart
    while batch:
        batch.step()
    assert [g.result.tokens for g in gens] == want
    assert len({tuple(w) for w in want}) == len(want)  # the settings really differ


def drive(be, prompts, arrivals, n):
    """Continuous batching by hand: prompt i joins at cycle arrivals[i]; a row leaves once it has n tokens."""
    outs, live, cycle = {}, [], 0
    while len(outs) < len(prompts) or live:
        for i, at in enumerate(arrivals):
            if at == cycle:
                outs[i] = [be.prefill([prompts[i]])[0] if not be.rows else be.admit(prompts[i])]
                live.append(i)
        done = [j for j, i in enumerate(live) if len(outs[i]) >= n]
        if done:
            be.retire(done)
            live = [i for i in live if len(outs[i]) < n]
        cycle += 1
        if not live:
            continue
        verified = be.verify(be.draft([outs[i][-1] for i in live]))
        keeps = [accepted_length(d, t) + 1 for d, t in zip(verified.proposals, verified.tokens)]
        for i, t, k in zip(live, verified.tokens, keeps):
            outs[i].extend(t[:k])
        be.commit(verified, keeps)
    return [outs[i][:n] for i in range(len(prompts))]


def test_rows_join_a_running_batch(pair, mixed_prompts):
    """Continuous batching: rows admitted between cycles (their own prefill, then merged) and retired as they
    finish; every row's greedy tokens are its batch-1 tokens."""
    target, drafter = pair
    solo = single(target, drafter)
    want = [generate(solo, p, max_new_tokens=40).tokens for p in mixed_prompts[:5]]
    be = batched(target, drafter)
    got = drive(be, mixed_prompts[:5], arrivals=[0, 0, 2, 3, 7], n=40)
    assert got == want


def test_sliding_window_drafter_in_a_batch(pair, mixed_prompts, tmp_path):
    """A drafter with sliding-window layers (per-row windows under the one mask rule) batches like batch 1."""
    import dataclasses

    from dflash.backends.torch.drafter import DFlashDrafter

    target, drafter = pair
    spec = dataclasses.replace(drafter.spec, layer_types=["sliding_attention"] * drafter.spec.num_hidden_layers,
                               sliding_window=6)
    sliding = DFlashDrafter(spec).eval()
    sliding.load_state_dict(drafter.state_dict())
    solo = single(target, sliding)
    want = [generate(solo, p, max_new_tokens=32, trace=True) for p in mixed_prompts[:4]]
    got = generate_batch(batched(target, sliding), mixed_prompts[:4], max_new_tokens=32, trace=True)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.drafted for g in got] == [w.drafted for w in want]


def test_batches_of_other_sizes_reuse_the_engine(pair, mixed_prompts):
    target, drafter = pair
    solo = single(target, drafter)
    want = [generate(solo, p, max_new_tokens=24).tokens for p in mixed_prompts[:5]]
    be = batched(target, drafter)
    for rows in ([0, 1, 2], [3, 4], [0, 1, 2, 3, 4], [2]):
        got = generate_batch(be, [mixed_prompts[i] for i in rows], max_new_tokens=24)
        assert [g.tokens for g in got] == [want[i] for i in rows]


@pytest.mark.parametrize("verify", ["chain", "tree"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, seed=0)])
def test_logprobs_are_the_targets_own(pair, mixed_prompts, verify, sampling):
    """Generation(logprobs=k): each emitted token's log-probability and its top k, computed in the verify forward,
    equal a plain target forward over prompt + output (log_softmax of logits / temperature), rows in a batch."""
    from dflash.core.loop import Batch, Generation

    target, drafter = pair
    be = batched(target, drafter)
    be.set_verify(verify, 15 if verify == "tree" else None)
    batch = Batch(be)
    gens = [Generation(be, p, max_new_tokens=24, sampling=sampling, logprobs=3) for p in mixed_prompts[:3]]
    incs = {id(g): [] for g in gens}
    for g in gens:
        incs[id(g)].append(batch.join(g))
    while batch:
        for g, inc in batch.step():
            incs[id(g)].append(inc)
    for g in gens:
        lps = [x for inc in incs[id(g)] for x in inc.logprobs]
        tops = [x for inc in incs[id(g)] for x in inc.top_logprobs]
        out = g.result.tokens
        assert len(lps) == len(tops) == len(out) == 24
        with torch.no_grad():
            logits = target(torch.tensor([g.prompt_ids + out])).logits[0, len(g.prompt_ids) - 1:-1].float()
        want = torch.log_softmax(logits / (sampling.temperature or 1.0), dim=-1)
        got_chosen = torch.tensor(lps)
        assert torch.allclose(got_chosen, want[torch.arange(len(out)), torch.tensor(out)], atol=2e-4)
        top_values, top_ids = want.topk(3, dim=-1)
        assert torch.allclose(torch.tensor([[v for _, v in t] for t in tops]), top_values, atol=2e-4)
        if sampling.greedy:
            assert [t[0][0] for t in tops] == out  # greedy: the emitted token is the top one


def test_a_joining_prompt_is_prefilled_between_cycles(pair, mixed_prompts):
    """Chunked admission: a joining row's prompt goes in 4 tokens per cycle of the running row, into caches of its
    own, then merges; both rows' greedy tokens are their batch-1 tokens."""
    target, drafter = pair
    solo = single(target, drafter)
    prompts = [mixed_prompts[2], max(mixed_prompts, key=len)]
    chunks = -(-len(prompts[1]) // 4)
    assert chunks >= 4
    want = [generate(solo, p, max_new_tokens=64).tokens for p in prompts]
    batch = Batch(batched(target, drafter))
    gens = [Generation(batch.engine, p, max_new_tokens=64) for p in prompts]
    batch.join(gens[0])
    admission, cycles = batch.begin(gens[1], chunk=4), 0
    while not admission.advance():
        batch.step()
        cycles += 1
    assert cycles == chunks - 1 and len(batch) == 1  # the running row decoded between the chunks
    batch.join(gens[1], admission)
    while batch:
        batch.step()
    assert [g.result.tokens for g in gens] == want


def test_a_failed_merge_leaves_the_batch_as_it_was(pair, mixed_prompts, monkeypatch):
    """Admission is all or nothing: when the drafter's caches cannot take the new row, the target's give it back,
    and the running row goes on to its batch-1 tokens."""
    target, drafter = pair
    want = generate(single(target, drafter), mixed_prompts[3], max_new_tokens=48).tokens
    batch = Batch(batched(target, drafter))
    gen = Generation(batch.engine, mixed_prompts[3], max_new_tokens=48)
    batch.join(gen)
    batch.step()

    def refuse(other):
        raise DFlashError("the drafter's caches refuse the row")

    monkeypatch.setattr(batch.engine.drafter, "merge", refuse)
    with pytest.raises(DFlashError):
        batch.join(Generation(batch.engine, mixed_prompts[4], max_new_tokens=8))
    monkeypatch.undo()
    assert len(batch.engine.rows) == 1 and len(batch) == 1
    while batch:
        batch.step()
    assert gen.result.tokens == want


def test_a_row_admitted_after_the_batch_emptied_runs_alone(pair, mixed_prompts):
    """The running row finishes while another's prompt goes in: the admitted row takes the engine's caches (the
    finished sequence's are not merged with it) and decodes its batch-1 tokens."""
    target, drafter = pair
    solo = single(target, drafter)
    want = generate(solo, mixed_prompts[7], max_new_tokens=32).tokens
    batch = Batch(batched(target, drafter))
    short = Generation(batch.engine, mixed_prompts[1], max_new_tokens=2)
    batch.join(short)
    gen = Generation(batch.engine, mixed_prompts[7], max_new_tokens=32)
    admission = batch.begin(gen, chunk=4)
    while not admission.advance():
        batch.step()
    assert short.result is not None and not batch
    batch.join(gen, admission)
    while batch:
        batch.step()
    assert gen.result.tokens == want and len(batch.engine.rows) == 1


def chain_cycles(target, drafter, prompts, kinds, eager: bool, before=None, after=None):
    """Chain cycles of `kinds` ("draft", or "plain": no draft forward) over a batch of `prompts`; eager: the drafter
    reads each plain cycle's features at once (what deferring them must equal). before / after(engine, kind) are
    noted per cycle. Returns (draft tokens per cycle and row, the rows' tokens, the notes)."""
    be = batched(target, drafter)
    anchors = be.prefill(prompts)
    out, notes = [], []
    for kind in kinds:
        notes.append(before(be, kind) if before else None)
        if kind == "plain" and eager:
            be.absorb_pending()
        steps = chain_cycle(be, anchors, length=0 if kind == "plain" else None)
        out.append([s.drafted for s in steps])
        anchors = [s.tokens[-1] for s in steps]
        if after:
            notes[-1] = (notes[-1], after(be, kind))
    tokens = [list(r) for r in be.rows]
    be.close()
    return out, tokens, notes


def test_plain_cycles_leave_features_pending_for_the_next_draft(pair, mixed_prompts, monkeypatch):
    """Rows that accepted different prefixes (ragged pending features), then plain cycles: the next draft proposes
    exactly what it proposes when every plain cycle had the drafter read its features at once, and the committed
    tokens are the target's own."""
    monkeypatch.setattr(engine_module, "PENDING_ABSORB", 1000)  # (however many wait: see the test below)
    target, drafter = pair
    prompts = mixed_prompts
    # (six drafted cycles first: a drafter trained in another environment may accept nothing on these prompts'
    # first cycles, and the plain cycles must come after rows accepted different prefixes)
    kinds = ["draft"] * 6 + ["plain", "draft", "plain", "plain", "plain", "draft", "plain", "draft"]
    ragged = lambda be, kind: kind == "plain" and len(set(be.pending.counts)) > 1  # noqa: E731
    waiting = lambda be, kind: kind != "plain" or (be.pending is not None and bool(be.pending.counts))  # noqa: E731
    deferred, rows_deferred, notes = chain_cycles(target, drafter, prompts, kinds, False, ragged, waiting)
    eager, rows_eager, _ = chain_cycles(target, drafter, prompts, kinds, True)
    assert any(r for r, _ in notes)  # (rows had accepted different prefixes when a plain cycle came)
    assert all(w for _, w in notes)  # (after a plain cycle the drafter has not read its features yet)
    assert deferred == eager and rows_deferred == rows_eager
    solo = single(target, drafter)
    for prompt, row in zip(prompts, rows_deferred):
        want = generate(solo, prompt, max_new_tokens=len(row) - len(prompt)).tokens
        assert row[len(prompt):] == want[: len(row) - len(prompt)]
    solo.close()


def test_a_long_pause_hands_its_pending_features_to_the_drafter(pair, mixed_prompts, monkeypatch):
    """Past PENDING_ABSORB pending positions a cycle without a draft forward has the drafter read them (the joins
    stay short); the next drafts propose exactly what they propose when every plain cycle's features were read at
    once."""
    monkeypatch.setattr(engine_module, "PENDING_ABSORB", 5)
    target, drafter = pair
    prompts, kinds = mixed_prompts[:3], ["draft"] + ["plain"] * 9 + ["draft", "draft"]
    width = lambda be, kind: None if be.pending is None else be.pending.features.shape[1]  # noqa: E731
    deferred, rows_deferred, notes = chain_cycles(target, drafter, prompts, kinds, False, after=width)
    eager, rows_eager, _ = chain_cycles(target, drafter, prompts, kinds, True)
    widths = [w for _, w in notes[1:10]]
    assert None in widths and max(w for w in widths if w is not None) < 5 + 16  # absorbed, and again
    assert deferred == eager and rows_deferred == rows_eager


def test_cycles_of_copied_nodes_alone_leave_features_pending_for_the_next_draft(pair):
    """--verify auto's cycles without a draft forward that verify the branch copied from the context: their accepted
    paths' features wait behind the earlier pending ones, and the next draft proposes exactly what it proposes when
    the drafter read them after every such cycle."""
    target, drafter = pair
    starts = [list(range(10 * i, 10 * i + 6)) for i in (1, 2, 3)]
    # each prompt holds its own greedy continuation once already: prompt lookup has something to copy
    repeating = [p + generate(single(target, drafter), p, max_new_tokens=12).tokens + p for p in starts]

    def run(eager: bool):
        be = batched(target, drafter)
        be.set_verify("auto", times=FixedTimes(plain=1.0, token=0.3 / 511, draft=0.3))  # verifying is nearly free
        anchors = be.prefill(repeating)
        out, copied = [], 0
        for kind in ["copy", "draft", "copy", "copy", "draft"]:
            be.policy.planner.pause.skip = 1 if kind == "copy" else 0  # (a pause: no draft forward this cycle)
            if kind == "copy" and eager:
                be.absorb_pending()
            steps = tree_cycle(be, anchors, be.policy.planner)
            if kind == "copy":
                copied += any(len(t.tokens) > 1 for t in be.policy.planner.last_trees)
                if eager:
                    be.absorb_pending()
            out.append([s.drafted for s in steps])
            anchors = [s.tokens[-1] for s in steps]
        tokens = [list(r) for r in be.rows]
        be.close()
        return out, tokens, copied

    (deferred, rows_deferred, copied), (eager, rows_eager, _) = run(eager=False), run(eager=True)
    assert copied and deferred == eager and rows_deferred == rows_eager


def test_a_draft_of_some_rows_proposes_what_the_whole_batchs_draft_does(pair, mixed_prompts):
    """draft(rows=...): those rows' blocks and candidates are the whole batch's draft's for them, and the batch's
    drafter cache is left as the whole draft leaves it (every row's pending context absorbed, no block kept)."""
    target, drafter = pair
    engines = [batched(target, drafter) for _ in range(2)]
    anchors = [e.prefill(mixed_prompts[:4]) for e in engines][0]
    whole = engines[0].draft(anchors, top_k=4)
    some = engines[1].draft(anchors, top_k=4, rows=[1, 3])
    assert some.ids.tolist() == whole.ids[[1, 3]].tolist()
    torch.testing.assert_close(some.top_probs, whole.top_probs[[1, 3]])
    assert engines[1].drafter.cache.lengths == engines[0].drafter.cache.lengths
    again = [e.draft(anchors, top_k=4) for e in engines]
    assert again[0].ids.tolist() == again[1].ids.tolist()


def test_rows_out_of_the_draft_forward_keep_their_batch1_output(pair, mixed_prompts, monkeypatch):
    """--verify auto with a different third of the rows out of every draft forward (their trees: the copied branch
    or the root alone): every row's greedy output is its batch-1 output."""
    target, drafter = pair
    cycles = []

    def drafting(planner, pauses):
        cycles.append(len(pauses))
        return [r for r in range(len(pauses)) if (r + len(cycles)) % 3]

    monkeypatch.setattr(budget.TreePlanner, "drafting_rows", drafting)
    want = [generate(single(target, drafter), p, max_new_tokens=48).tokens for p in mixed_prompts[:6]]
    be = batched(target, drafter)
    be.set_verify("auto", times=FixedTimes(plain=1.0, token=0.3 / 511, draft=0.3))
    be.policy.planner.path = lambda *_: "tree"
    drafted_rows, propose = [], be.drafter.propose
    be.drafter.propose = lambda *a, rows=None, **k: drafted_rows.append(rows) or propose(*a, rows=rows, **k)
    got = generate_batch(be, mixed_prompts[:6], max_new_tokens=48)
    assert [g.tokens for g in got] == want
    assert sum(rows is not None for rows in drafted_rows) >= 4, drafted_rows
