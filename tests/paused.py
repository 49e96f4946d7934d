"""--verify auto's pause, checked the same way on both backends: a paused cycle is the plain step."""

from __future__ import annotations

from dflash.core.policy import ChainBudget
from dflash.core.contract import Pipelining
from dflash.core.loop import generate
from cycle_devices import FixedTimes
from fakes import Counting

STEEP = FixedTimes(plain=1.0, token=0.05, draft=0.5)  # a tree pays: auto drafts at first


class ScriptedPauses(ChainBudget):
    """--verify auto's chain budget with its pauses fixed (1, 2, 4 .. 16 plain cycles after each drafted one),
    whatever the cycles measure."""

    def __init__(self, block_size):
        super().__init__(block_size, STEEP)
        self.next_pause = 1

    def length(self, rows=1):
        if self.pause.waits():
            return 0
        self.pause.skip, self.next_pause = self.next_pause, min(2 * self.next_pause, 16)
        return 3  # (proposals verified)

    def observe(self, length, accepted, seconds):
        pass


def check_paused_cycles(backend, ar, prompt, paused=6):
    """--verify auto pausing an untrained drafter, without the copied branch: each paused cycle calls the target's
    primitives exactly as a target-only step does (no feature join, no slicing), plans nothing and leaves the drafter
    alone; the probe that ends the pause reads every position the pause committed in one Pending, and the output is
    the target's. `ar`: a target-only engine on the same target. On a lazy target both run their steps one ahead
    (dflash/core/lookahead.py), the last paused cycle too: the probe after it drafts beside that step."""
    backend.set_verify("auto", None, STEEP, copy_branch=False)
    want = generate(ar, prompt, max_new_tokens=32).tokens
    plans, read = [], []  # plan() calls; the pending positions each draft forward reads
    plan, propose = backend.policy.planner.plan, backend.drafter.propose
    backend.policy.planner.plan = lambda *a, **k: plans.append(1) or plan(*a, **k)
    backend.drafter.propose = lambda ids, p, *a, **k: read.append(p and p.counts[0]) or propose(ids, p, *a, **k)
    anchor = backend.step(backend.prefill([prompt]))[0].tokens[-1]  # a drafted cycle: its features wait
    waiting, plain = backend.pending.counts[0], ar.prefill([prompt])
    issued = backend.lookahead.anchors is not None  # (a drafted cycle that planned no node and paused runs ahead)
    backend.target, backend.drafter = Counting(backend.target), Counting(backend.drafter)
    ar.target = Counting(ar.target)
    plans.clear()
    backend.policy.planner.pause.skip = paused
    for _ in range(paused):
        step = backend.step([anchor])[0]
        assert not step.draft_forward
        anchor, plain = step.tokens[-1], [ar.step(plain)[0].tokens[-1]]
    plain_calls = ar.target.calls
    if isinstance(ar.target.inner, Pipelining):
        assert plain_calls["start"] == paused + 1  # (its first step starts its own forward, then the next's)
        if issued:  # (the first paused cycle takes that step: the target-only engine issued and started its own)
            plain_calls.subtract({"ids": 1, "forward": 1, "sample": 1, "start": 1})
    assert backend.target.calls == +plain_calls and not backend.drafter.calls and not plans
    backend.step([anchor])  # the probe
    assert read[-1] == waiting + paused
    assert backend.drafter.position + backend.pending.counts[0] == len(backend.tokens)
    out = backend.tokens[len(prompt):]
    assert out == want[: len(out)] and len(out) > paused
