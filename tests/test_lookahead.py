"""A lazy target's plain steps run one ahead of the host (dflash/core/lookahead.py), on numpy fakes: the output is
the steps' run in turn, token for token, and whatever ends a row (EOS, max_new_tokens, a stop string, a crop, the
batch it leaves) finds the target cache holding exactly the committed tokens, never the step ahead's."""

import pytest
from fakes import FakeDrafter, FakeTarget, LazyFakeTarget, next_token
from paused import ScriptedPauses

from dflash.core.engine import Engine
from dflash.core.lookahead import Lookahead
from dflash.core.loop import Batch, Generation, generate, generate_batch
from dflash.core.policy import Policy

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8]]


def reference(prompt, n):
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history))
    return history[len(prompt):]


class Symbols:
    """Token i decodes to one printable character (the fake's vocabulary of 64)."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(48 + i) for i in ids)


def cached(engine):
    """What the target cache holds per row (the fake's cache is its ids); the engine's rows when nothing is ahead."""
    return engine.target.rows


def test_it_runs_where_a_cycle_is_one_plain_forward_of_a_lazy_target():
    runs = lambda engine: engine.lookahead.runs(engine)  # noqa: E731
    assert runs(Engine(LazyFakeTarget()))
    assert not runs(Engine(FakeTarget()))  # (no start: torch steps in turn)
    assert runs(Engine(LazyFakeTarget(), FakeDrafter(), block_size=4))  # (its paused cycles)
    with_logprobs = Engine(LazyFakeTarget())
    with_logprobs.logprobs = 2
    assert not runs(with_logprobs)
    swapped = Engine(LazyFakeTarget())
    assert runs(swapped)
    swapped.target = FakeTarget()  # (a target swapped after a check is checked again)
    assert not runs(swapped)


@pytest.mark.parametrize("bounded", [False, True])  # bounded: the cache goes back within its last forward only
@pytest.mark.parametrize("n", [1, 2, 3, 17])
def test_output_is_the_steps_in_turn_and_the_cache_the_committed_tokens(n, bounded):
    engine = Engine(LazyFakeTarget(bounded))
    r = generate(engine, PROMPTS[0], max_new_tokens=n)
    assert r.tokens == reference(PROMPTS[0], n) and r.finish_reason == "length"
    assert r.tokens == generate(Engine(FakeTarget(bounded)), PROMPTS[0], max_new_tokens=n).tokens
    assert cached(engine) == [PROMPTS[0] + r.tokens[:-1]] == [engine.tokens]  # (the last token is not fed yet)


def test_every_step_starts_the_next_before_it_reads_its_own():
    engine = Engine(LazyFakeTarget())
    generate(engine, PROMPTS[0], max_new_tokens=6)
    log = engine.target.log
    assert log[0] == "read"  # (the prefill's first token)
    # (the first step starts its own forward, then the next's; every later one's own was started by the one before)
    assert log[1:] == ["start", "start", "read"] + ["start", "read"] * 4


class Clock:
    """perf_counter for dflash.core.cycle and .lookahead, moved only by what the target computes."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class ComputingTarget(LazyFakeTarget):
    """Where starting a forward computes it (MLX's CPU backend): each start takes one second of the fake clock."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def start(self, *arrays):
        super().start(*arrays)
        self.clock.now += 1.0


# (a step that no step before it started is computed by its read, which the fake clock does not see: 0 seconds)
@pytest.mark.parametrize("again, expected", [([True, True, True, False], [1.0] * 4), ([True, False], [1.0] * 2),
                                             ([False, True, False], [0.0, 1.0, 1.0]), ([False, False], [0.0] * 2)])
def test_each_paused_cycle_is_charged_its_own_forward(monkeypatch, again, expected):
    """A step issued ahead is computed in the cycle that issues it; the clock charges it to the cycle that takes it,
    so the policy learns one forward per plain cycle, not a double and a zero (tests the CycleClock's shift)."""
    import dflash.core.cycle as cycle
    import dflash.core.lookahead as lookahead

    clock = Clock()
    monkeypatch.setattr(cycle.time, "perf_counter", clock)
    monkeypatch.setattr(lookahead.time, "perf_counter", clock)
    engine = Engine(ComputingTarget(clock))
    r = generate(engine, PROMPTS[0], max_new_tokens=1)
    anchors, seconds = [r.tokens[-1]], []
    for a in again:
        start = engine.clock.begin()
        steps = engine.lookahead.step(engine, anchors, again=a)
        seconds.append(engine.clock.since(start))
        anchors = [steps[0].tokens[-1]]
    assert seconds == expected
    assert engine.tokens == PROMPTS[0] + reference(PROMPTS[0], 1 + len(again))[:-1]


@pytest.mark.parametrize("bounded", [False, True])
def test_a_request_after_an_early_eos_is_a_fresh_engines(bounded):
    engine = Engine(LazyFakeTarget(bounded))
    ref = reference(PROMPTS[0], 30)
    r = generate(engine, PROMPTS[0], max_new_tokens=30, eos_token_ids=[ref[4]])
    assert r.tokens == ref[: ref.index(ref[4]) + 1] and r.finish_reason == "stop"
    assert cached(engine) == [engine.tokens]
    follow = PROMPTS[0] + r.tokens + [9]  # a chat's next turn: it reuses the cached prefix
    again = generate(engine, follow, max_new_tokens=12)
    assert again.tokens == generate(Engine(LazyFakeTarget(bounded)), follow, max_new_tokens=12).tokens
    assert again.tokens == reference(follow, 12) and cached(engine) == [engine.tokens]
    assert engine.last_reused > len(PROMPTS[0]) or bounded  # (a bounded cache starts over)


def test_a_stop_string_mid_stream_emits_nothing_past_it_and_leaves_the_cache_right():
    tok = Symbols()
    text = tok.decode(reference(PROMPTS[0], 40))
    stop = text[9:11]
    engine = Engine(LazyFakeTarget())
    gen = Generation(engine, PROMPTS[0], tokenizer=tok, max_new_tokens=40, stop_strings=[stop])
    streamed = "".join(inc.text for inc in gen)
    r = gen.result
    assert streamed == r.text == text[: text.index(stop)] and r.finish_reason == "stop"
    assert tok.decode(r.tokens) == text[: text.index(stop) + len(stop)]
    assert cached(engine) == [PROMPTS[0] + r.tokens[:-1]]
    assert generate(engine, PROMPTS[1], max_new_tokens=9).tokens == reference(PROMPTS[1], 9)


def test_batch_rows_are_batch_1s_and_a_row_that_leaves_takes_nothing_ahead_with_it():
    eos = reference(PROMPTS[1], 30)[3]  # row 1 stops early, the others run on
    alone = [generate(Engine(FakeTarget()), p, max_new_tokens=20, eos_token_ids=[eos]).tokens for p in PROMPTS]
    batched = generate_batch(Engine(LazyFakeTarget()), PROMPTS, max_new_tokens=20, eos_token_ids=[eos])
    assert [r.tokens for r in batched] == alone and batched[1].finish_reason == "stop"
    engine = Engine(LazyFakeTarget())
    batch = Batch(engine)
    gens = [Generation(engine, p, max_new_tokens=20, eos_token_ids=[eos]) for p in PROMPTS]
    for g in gens:
        batch.join(g)
    while len(batch) == len(PROMPTS):
        batch.step()
    assert gens[1].result is not None and cached(engine) == engine.rows  # the rows that stay: nothing ahead
    late = Generation(engine, PROMPTS[1], max_new_tokens=20)
    batch.join(late)  # a row joining the running batch
    while batch:
        batch.step()
    assert [g.result.tokens for g in gens] == alone
    assert late.result.tokens == reference(PROMPTS[1], 20)


def test_a_step_that_does_not_continue_the_step_ahead_runs_its_own():
    engine, serial = Engine(LazyFakeTarget()), Engine(FakeTarget())
    for e in (engine, serial):
        first = e.prefill([PROMPTS[2]])[0]
        e.step([first])
    other = 11  # not the token drawn: the step ahead read another
    step = engine.step([other])[0]
    assert step.tokens == serial.step([other])[0].tokens and engine.tokens == serial.tokens
    assert cached(engine) == [engine.tokens + step.tokens]  # (the step ahead, from the token just drawn)


def test_a_crop_after_a_step_forgets_the_step_ahead():
    engine = Engine(LazyFakeTarget())
    anchor = engine.prefill([PROMPTS[0]])[0]
    for _ in range(4):
        anchor = engine.step([anchor])[0].tokens[-1]
    engine.crop(5)
    assert cached(engine) == [engine.tokens] == [(PROMPTS[0] + reference(PROMPTS[0], 4))[:5]]


def paused_engine(target):
    """A drafter that is never right, paused as --verify auto pauses it."""
    engine = Engine(target, FakeDrafter(good=0), block_size=4)
    engine.policy = Policy(chain_budget=ScriptedPauses(4))
    return engine


def test_a_pause_runs_ahead_but_its_last_cycle_and_the_drafter_reads_every_committed_position():
    engine = paused_engine(LazyFakeTarget())
    r = generate(engine, PROMPTS[0], max_new_tokens=60)
    assert r.tokens == reference(PROMPTS[0], 60)
    assert "".join(".D"[d] for d in r.draft_forwards).startswith("D.D..D....D........D" + "." * 16 + "D")
    # a paused cycle starts the next unless a probe follows it; a drafted cycle reads once and starts nothing
    starts = engine.target.log.count("start")
    ended_mid_pause = engine.policy.chain_budget.pause.going
    # every paused cycle but a pause's last starts the next; a pause's first also starts its own before it
    runs = [len(run) for run in "".join(".D"[d] for d in r.draft_forwards).split("D") if run]
    if ended_mid_pause:
        runs[-1] += 1  # (its last cycle started one more)
    assert starts == sum(n - 1 + (n > 1) for n in runs)
    # the features of the steps ahead that were taken reached the drafter: its context + pending is the committed
    # ids, position for position (the fake's features are its input ids)
    pending = engine.pending
    waiting = [int(x) for x in pending.features[0, : pending.counts[0], 0]] if pending is not None else []
    assert engine.drafter.context[0] + waiting == engine.tokens
    assert cached(engine) == [engine.tokens]  # (a finished row drops the step ahead)


def test_paused_rows_of_a_batch_run_ahead_and_each_is_its_row_alone():
    alone = [generate(paused_engine(FakeTarget()), p, max_new_tokens=40).tokens for p in PROMPTS]
    batched = generate_batch(paused_engine(LazyFakeTarget()), PROMPTS, max_new_tokens=40)
    assert [b.tokens for b in batched] == alone == [reference(p, 40) for p in PROMPTS]
