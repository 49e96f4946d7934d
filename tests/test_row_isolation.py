"""A row whose step raises in the middle of a batch fails alone (dflash.core.loop.Batch._isolate): through the server's
engine thread, its request gets an error event while 8 greedy neighbours finish exactly as they do alone. A fault
that only the batch has (every row replays clean alone) fails no request: one log line says so and the rows go on.
Also the admission bound with --max-queue 0 (capacity = max batch)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

pytest.importorskip("torch")
from dflash.backends.torch.sampling import TorchSampler  # noqa: E402
from dflash.core.loop import Generation  # noqa: E402
from dflash.core.sampling import SamplingParams  # noqa: E402
from dflash.server.metrics import Metrics  # noqa: E402
from dflash.server.scheduler import Job, QueueFull, Scheduler  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def parse(text):", "for i in range(10):",
           "def __init__(self, name):", "while True:", "def add(a, b):"]
POISON_SEED = 666  # a greedy row with this seed (and a repetition penalty: the per-row sampler path) blows up


@pytest.fixture(scope="module")
def pipe():
    import dflash

    return dflash.load(backend="torch", device="cpu", verify="chain")


@pytest.fixture(scope="module")
def solo(pipe):
    return [pipe.generate(p, max_new_tokens=40).tokens for p in PROMPTS]


@pytest.mark.parametrize("fault", ["sampler", "forward"])
def test_a_failing_row_fails_alone(pipe, solo, monkeypatch, fault):
    engine = pipe.engine
    if fault == "sampler":
        draws = {"poisoned": 0}
        real_draw = TorchSampler.draw

        def draw(self, scores, gumbel):
            if self.params.seed == POISON_SEED:
                draws["poisoned"] += 1
                if draws["poisoned"] > 3:  # after its prefill and two cycles: mid-batch
                    raise RuntimeError("probability tensor contains either inf, nan or element < 0")
            return real_draw(self, scores, gumbel)

        monkeypatch.setattr(TorchSampler, "draw", draw)
        message = "probability tensor"
    else:  # the batch's forward raises once the poisoned row has generated a few tokens
        poison = pipe.encode("def poisoned():")
        real_forward = type(engine.target).forward

        def forward(self, ids, last_only, tree=None):
            if self is engine.target and any(r[:len(poison)] == poison and len(r) > len(poison) + 8
                                             for r in engine.rows):
                raise RuntimeError("illegal memory access")
            return real_forward(self, ids, last_only, tree)

        monkeypatch.setattr(type(engine.target), "forward", forward)
        message = "illegal memory access"
    params = [SamplingParams()] * 4 + [SamplingParams(repetition_penalty=1.2, seed=POISON_SEED)] + \
        [SamplingParams()] * 4
    outcomes, scheduler = serve(pipe, PROMPTS[:4] + ["def poisoned():"] + PROMPTS[4:], params)
    kinds = [k for k, _ in outcomes]
    assert kinds == ["done"] * 4 + ["error"] + ["done"] * 4, outcomes[4]
    assert message in outcomes[4][1]
    got = [r.tokens for k, r in outcomes if k == "done"]
    assert got == solo
    assert scheduler.accepted == 0


def serve(pipe, prompts, params):
    """Every prompt submitted at once to a Scheduler's engine thread; each one's last event, and the scheduler."""
    engine = pipe.engine
    scheduler = Scheduler(engine, Metrics(engine.block_size), max_batch=16, max_queue=0)

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [Job(Generation(engine, pipe.encode(p), tokenizer=pipe.tokenizer, max_new_tokens=40, sampling=s,
                               eos_token_ids=pipe.eos_token_ids), loop) for p, s in zip(prompts, params)]
        for job in jobs:
            scheduler.submit(job)
        scheduler.start()
        outcomes = []
        for job in jobs:
            while True:
                kind, payload = await asyncio.wait_for(job.events.get(), 120)
                if kind != "delta":
                    outcomes.append((kind, payload))
                    break
        return outcomes

    try:
        return asyncio.run(run()), scheduler
    finally:
        scheduler.stop(5)


def test_a_batch_fault_fails_no_row(pipe, solo, monkeypatch, caplog):
    """The target's forward raises twice on a batch of several rows and never on one: every row replays clean
    alone, so no request fails; each fault is one warning line (its traceback at debug level), and every row's
    output is its output alone."""
    engine = pipe.engine
    real_forward = type(engine.target).forward
    faults = {"left": 2, "cycles": 0}

    def forward(self, ids, last_only, tree=None):
        if self is engine.target and ids.shape[0] > 1:
            faults["cycles"] += 1
            if faults["cycles"] % 3 == 0 and faults["left"]:  # mid-batch, twice
                faults["left"] -= 1
                raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")
        return real_forward(self, ids, last_only, tree)

    monkeypatch.setattr(type(engine.target), "forward", forward)
    with caplog.at_level(logging.DEBUG, logger="dflash"):
        outcomes, scheduler = serve(pipe, PROMPTS, [SamplingParams()] * len(PROMPTS))
    assert faults["left"] == 0, "the fault was never injected"
    assert [k for k, _ in outcomes] == ["done"] * len(PROMPTS), outcomes
    assert [r.tokens for _, r in outcomes] == solo
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all("batch fault" in r.getMessage() and "CUBLAS" in r.getMessage()
                                      and r.exc_info is None for r in warnings), [r.getMessage() for r in warnings]
    tracebacks = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(tracebacks) == 2
    assert scheduler.accepted == 0


def test_max_queue_0_admits_max_batch():
    engine = SimpleNamespace(block_size=4)
    scheduler = Scheduler(engine, Metrics(4), max_batch=2, max_queue=0)
    job = SimpleNamespace(cancelled=False)
    scheduler.submit(job)
    scheduler.submit(job)
    with pytest.raises(QueueFull):
        scheduler.submit(job)


def test_overflowing_scores_never_fail_the_draw():
    """Gumbel-max draws need no normalisation: a row of inf / nan scores takes its largest finite-or-inf score
    (nan counts as -inf) instead of failing the batch's draw."""
    import torch

    sampler = TorchSampler(SamplingParams(temperature=1.0, seed=0))
    scores = torch.tensor([[float("inf"), 0.0, float("nan")], [0.0, 0.0, 50.0]])
    assert sampler.draw(scores, torch.zeros(2, 3)).tolist() == [0, 2]
