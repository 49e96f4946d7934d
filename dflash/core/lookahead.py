"""A plain step run one step ahead of the host, as mlx-lm's generate_step runs: the next step's forward is built
from this step's drawn tokens while they are still on the device, and started (contract.Pipelining) before the host
reads them, so the device works while Python builds the next graph and does the loop's bookkeeping (on MLX's CPU
backend async_eval returns with a few dozen ops still queued: that tail is what the overlap covers there).

It runs where a cycle is one target forward of the anchors alone (no draft forward, no log-probs) on a target whose
arrays are lazy (MLX): every cycle of a drafter-less engine, and the cycles that --verify auto pauses, whose caller
says whether the next cycle pauses too (a probe or a verified branch after it reads the target cache as the cycles
committed it). The step ahead is exactly the one the next cycle would run: its input the tokens drawn now, its history
this step's plus them, its draws those of the next position; the next cycle takes it, with its target features for
the drafter, when its anchors are those tokens. Meanwhile the target cache holds one position per row past the
engine's committed rows. Every engine method that reads or changes the caches first forgets it (`drop`, through
`lands`), so a row that stopped (EOS, a stop string, max_new_tokens), a joining row, a drafted cycle, a crop or a reset
finds the caches exactly as the cycles committed them: a row's stop costs one forward of work, never a token.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Concatenate, ParamSpec, Protocol, Sequence, TypeVar, cast

from .cycle import CycleClock, CycleEngine
from .contract import Array, Pipelining, Step, Target, Verified


class Landing(Protocol):
    """What forgetting the step ahead needs of an engine: its target and rows."""

    lookahead: Lookahead
    clock: CycleClock

    @property
    def target(self) -> Target: ...
    @property
    def rows(self) -> list[list[int]]: ...


class PlainEngine(CycleEngine, Protocol):
    """What the step ahead needs of its engine (dflash.core.engine.Engine)."""

    logprobs: int | None
    lookahead: Lookahead


class Lookahead:
    """The one step issued ahead of an engine's rows, if any."""

    def __init__(self) -> None:
        self.anchors: list[int] | None = None  # the tokens it reads (the next cycle's anchors), on the host
        self.tokens: Array = None  # what it draws (rows, 1), on the device
        self.features: Array = None  # its target features (the drafter's, once committed), on the device
        self.issued = 0.0  # wall seconds issuing it took (on a CPU, most of its forward): the cycle that takes or
        # drops it pays them (CycleClock)
        self.target: Target | None = None  # the target `runs` last checked, and whether it pipelines
        self.pipelines = False

    def runs(self, engine: PlainEngine) -> bool:
        """Whether the engine's plain steps can run one ahead (the protocol check kept per target: it costs as much
        as a tenth of the host's work of a plain step)."""
        if engine.target is not self.target:
            self.target, self.pipelines = engine.target, isinstance(engine.target, Pipelining)
        return engine.logprobs is None and self.pipelines

    def step(self, engine: PlainEngine, anchors: Sequence[int], again: bool = True) -> list[Step]:
        """A plain step for every row: the one issued ahead if it reads these anchors, else one issued now. `again`:
        the next cycle is a plain step too, so it is issued and started before this one's tokens are read."""
        target = engine.target
        start = cast(Pipelining, target).start  # (runs(engine))
        anchors = list(anchors)
        taken = self.anchors == anchors
        if taken:
            tokens, features = self.tokens, self.features
            engine.clock.shift += self.issued
        else:
            self.drop(engine)
            tokens, features = _draw(engine, target.ids([[a] for a in anchors]), engine.rows, offset=1)
        self.anchors = self.tokens = self.features = None
        self.issued = 0.0
        if again:
            if not taken:  # (this step's own forward first, so that issuing the next times the next alone)
                start(tokens)
            issuing = time.perf_counter()
            ahead, ahead_features = _draw(engine, tokens, [row + [a] for row, a in zip(engine.rows, anchors)],
                                          offset=2)
            start(ahead)
            self.issued = time.perf_counter() - issuing
            engine.clock.shift -= self.issued
        drawn = target.to_host(tokens)  # the cycle's one device -> host read, while the step ahead runs
        if again:
            self.anchors, self.tokens, self.features = [t for t, in drawn], ahead, ahead_features
        # every row keeps its one position, which changes no cache: committed after the step ahead's forward, it is
        # this step's commit all the same
        engine.commit(Verified([[a] for a in anchors], drawn, features), [1] * len(anchors))
        return [Step(row, [], 0, draft_forward=False) for row in drawn]

    def drop(self, engine: Landing) -> None:
        """Forget the step ahead, if one was issued: the target cache ends at the engine's rows again."""
        if self.anchors is None:
            return
        self.anchors = self.tokens = self.features = None
        engine.clock.shift += self.issued  # (a forward for nothing: the cycle that drops it pays it)
        self.issued = 0.0
        if not engine.target.keep([0] * len(engine.rows), 1):
            raise AssertionError("the last forward can always be rewound")


def _draw(engine: PlainEngine, ids: Array, histories: list[list[int]], offset: int) -> tuple[Array, Array]:
    """Each row's token after `ids` (rows, 1) that follow `histories`, drawn at its cached length + offset, and the
    forward's target features."""
    logits, features = engine.target.forward(ids, last_only=False)
    tokens = engine.target.sample(logits, histories, ids, engine.row_sampling, draws=engine.row_draws(1, offset))
    return tokens, features


E = TypeVar("E", bound=Landing)
P = ParamSpec("P")
R = TypeVar("R")


def lands(method: Callable[Concatenate[E, P], R]) -> Callable[Concatenate[E, P], R]:
    """An engine method that reads or changes the caches: the step ahead is forgotten first."""

    @functools.wraps(method)
    def landed(engine: E, /, *args: P.args, **kwargs: P.kwargs) -> R:
        engine.lookahead.drop(engine)
        return method(engine, *args, **kwargs)

    return landed
