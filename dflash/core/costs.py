"""What a draft and a verify cost on this device, measured once per model shape + device + dtype and cached.

`--verify auto` needs T_draft(rows) and T_verify(rows, n) in seconds: on an H200 a verify is nearly flat up to
hundreds of tokens, on a 2-core CPU it grows with every token, and a batch of rows costs a GPU little more than one
row below its compute knee and a CPU every row's tokens; the budget rule (dflash/core/budget.py) has to know which.
The profile runs the engine's own primitives (the plain step, the tree forward, the draft) after a short context, so
it measures exactly what the cycles will run: one row at token counts doubling up to where a verify costs 4 plain
steps, the draft at the drafter's block and at shorter ones, batches of 4 and 16 rows at a few tokens per row where
one row of as many tokens is fast (more rows and tokens are interpolated or extrapolated); then a plain step, a
block's verify and a draft of one row after a longer context. Every point is timed in up to MAX_ROUNDS
interleaved rounds and the median kept (a burst of other load spoils one sample of each point, not every sample of
one). It takes a few seconds on a quiet machine, a minute or two under load; it prints one line when it starts, one
every few seconds naming the point being timed (dflash/core/progress.py), and one when done (stderr); it is then
read from $DFLASH_CACHE_DIR/costs/ (default ~/.cache/dflash/costs/).

A cached profile is used only if it is sane: more tokens never cost less, and its plain step is within LIVE_TOLERANCE
of one timed now (a profile measured while another process held the core is measured again). What remains off is
corrected while the engine runs (dflash/core/corrections.py: per cycle shape, from the cycles' own wall times, saved
beside the profile); a profile the cycles found off by more than DRIFT_TOLERANCE on average is measured again at the
next load, once: a factor per shape repairs each shape's level but not the curve within it (measured under load, a
verify of 2 to 16 tokens came out nearly flat), and one load taken on a quiet machine should not be spent on it
twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from .budget import MAX_TOP_K
from .cost_model import Costs, interpolate
from .corrections import Corrections
from .io import cache_root
from .progress import Heartbeat, note
from .tree import TreeInputs, chain_tree

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # single-row verify tokens (the planner interpolates between them)
BATCH_ROWS = (4, 16)  # batches measured too (where the backend batches); more rows are extrapolated
BATCH_TOKENS = (1, 4, 16)  # ... times tokens per row (at most the block, and what the single-row grid reached)
DRAFT_BLOCKS = (2, 4, 8)  # shorter draft forwards measured too (auto drafts fewer positions where depth does not pay)
CONTEXT = 64  # positions before the measured forwards ...
LONGER_CONTEXT = 320  # ... and again after these (a serving load's rows: prompt + answer), at fewer points
BATCH_SECONDS = 0.25  # batches are measured where one row of as many tokens takes less than this
# timings of every point, interleaved, the median kept: as many rounds as take about ROUNDS_SECONDS, at most
# MAX_ROUNDS (a small model's 1- and 2-token verifies differ by less than three timings' noise, and a profile that
# priced them alike verified a node of 1% every probe of a drafter never right)
ROUNDS_SECONDS = 4.0
MAX_ROUNDS = 9
LIVE_TOLERANCE = 3.0  # a cached plain step this many times slower or faster than one timed now is measured again
# a cached profile whose saved corrections put the cycles' wall time this many times over or under its predictions
# on average (over every cycle run with it: the corrections' all-shapes factor) is measured again at the next load
DRIFT_TOLERANCE = 1.5


# the engine code whose speed a profile measured: bumped when a forward gets faster, so cached profiles are measured
# anew (as a new grid, shape or device is)
PROFILE_VERSION = 4


def cache_dir() -> Path:
    return cache_root() / "costs"


def cost_key(engine) -> str:
    """Costs depend on shapes (target and drafter), backend, device, dtype and threads, not on the weights' values."""
    info = engine.info
    parts = [PROFILE_VERSION, GRID, BATCH_ROWS, BATCH_TOKENS, DRAFT_BLOCKS, CONTEXT, LONGER_CONTEXT, engine.name,
             info.model_type, info.hidden_size, info.num_hidden_layers, info.vocab_size,
             engine.block_size, engine.target.device_key()]
    if engine.drafter is not None:
        spec = engine.drafter.spec
        parts += [spec.architecture, spec.context_mode, spec.num_hidden_layers, spec.hidden_size,
                  spec.intermediate_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                  spec.num_context_layers, spec.layer_types, spec.sliding_window,
                  # the draft head's rows (a draft vocabulary: most of a small drafter's forward) and DFlash2's parts
                  spec.draft_vocab_size if spec.has_draft_vocab else None, spec.conv_kernel_size, spec.conv_group_size,
                  spec.selector_rank, spec.selector_top_k]
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def measured_costs(engine, max_tokens: int = 257, use_cache: bool = True, label: str | None = None) -> Costs:
    """The engine's costs, from the cache or measured now (the engine is reset either way); their online corrections
    are read from and saved beside the cache file. `label` names the model in the notice."""
    key = cost_key(engine)
    path = cache_dir() / f"{key}.json"
    corrections = Corrections.load(path.with_suffix(".corrections.json")) if use_cache else Corrections()
    note("checking the cached cost profile against a plain step timed now")
    costs, stale = cached(engine, path, max_tokens, corrections) if use_cache else (None, Stale())
    if costs is None:
        name = label or f"{engine.info.model_type} ({engine.name})"
        print(f"dflash: measuring this device's draft and verify costs for {name} " +
              (f"again ({stale.why})" if stale.why else "(--verify auto, first run only)") +
              ": seconds on a quiet machine, a minute or two under load ...",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        with Heartbeat("measuring", start):
            costs = measure(engine, max_tokens)
        print(f"dflash: measured in {time.perf_counter() - start:.1f} s" +
              (f"; cached in {path.parent}" if use_cache else ""), file=sys.stderr, flush=True)
        corrections = Corrections(path=corrections.path)  # (what was learnt against the old profile does not apply)
        if use_cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(costs.to_json() | {"device": engine.target.device_key(), "max_tokens": max_tokens,
                                                         "after_drift": stale.drifted}))
            tmp.replace(path)
    costs.corrections = corrections
    return costs


class Stale(NamedTuple):
    """Why a cached profile is measured again ("": there is none yet); `drifted`: its cycles found it off (the profile
    measured in its place is not drift-checked again, so a systematic bias cannot make every load measure)."""

    why: str = ""
    drifted: bool = False


def cached(engine, path: Path, max_tokens: int, corrections: Corrections) -> tuple[Costs | None, Stale]:
    """The profile cached at `path` if it is usable here, else (None, why it is measured again; a profile measured
    for fewer tokens than `max_tokens` is too). `corrections`: what the cycles learnt of it so far."""
    if not path.exists():
        return None, Stale()
    try:
        data = json.loads(path.read_text())
        costs, measured_for = Costs.from_json(data), int(data.get("max_tokens", 0))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None, Stale("its cache file was damaged")
    problem = insane(costs)
    if problem:
        return None, Stale(f"the cached profile {problem}")
    if measured_for < max_tokens:
        return None, Stale(f"up to {max_tokens} tokens")
    live = live_plain_step(engine)
    cached_step = costs.verify_seconds(1, context=fitting(engine, CONTEXT))
    if not 1 / LIVE_TOLERANCE <= live / cached_step <= LIVE_TOLERANCE:
        return None, Stale(f"its cached plain step, {cached_step * 1e3:.1f} ms, is far from this run's, "
                           f"{live * 1e3:.1f} ms")
    drift = corrections.overall()
    if drift is not None and not data.get("after_drift") and not 1 / DRIFT_TOLERANCE <= drift <= DRIFT_TOLERANCE:
        return None, Stale(f"the cycles run with it took {drift:.2f}x its predictions on average", drifted=True)
    return costs, Stale()


def insane(costs: Costs) -> str | None:
    """Why a profile cannot be right (None: it may be): a point that is not positive, or more tokens per row costing
    less than fewer (measurement keeps every curve monotone, so such a file was damaged or measured by other code)."""
    curves = [costs.verify, *costs.batch.values()]
    if costs.longer is not None:
        curves += [costs.longer.verify, *costs.longer.batch.values()]
    if costs.draft < 0:
        return "has a negative draft time"
    for points in curves:
        if any(t <= 0 for _, t in points):
            return "has a time that is not positive"
        if any(b[0] <= a[0] or b[1] < a[1] for a, b in zip(points, points[1:])):
            return "is not monotone in tokens"
    return None


def fitting(engine, context: int) -> int:
    """`context`, or half the target's context where that is shorter (a target of 16 positions is profiled too)."""
    return max(1, min(context, (engine.max_context or 2 * context) // 2))


def live_plain_step(engine, repeats: int = 3) -> float:
    """The median of `repeats` plain steps (one token, one row) after CONTEXT positions, timed now (engine reset)."""
    probe = Probe(engine, fitting(engine, CONTEXT))
    settled(lambda: probe.verify(1))  # (warm-up: a compiled target compiles here)
    seconds = statistics.median(probe.verify(1) for _ in range(repeats))
    engine.reset()
    return seconds


class Probe:
    """Timed forwards of the engine's own primitives after `context` cached positions: a chain-shaped tree of n
    tokens per row (the tree path's own mask and positions; one token: the plain step), and a draft of `block`
    positions."""

    def __init__(self, engine, context: int, rows: int = 1):
        self.engine, self.target, self.drafter = engine, engine.target, engine.drafter
        vocab = engine.info.vocab_size
        self.prompt = [(31 * i + 7) % vocab for i in range(context)]
        self.anchor = self.prompt[-1]
        engine.reset()
        engine.prefill([self.prompt] * rows)

    def rows(self, rows: int) -> None:
        self.engine.prefill([self.prompt] * rows)

    def verify(self, n: int, rows: int = 1) -> float:
        target = self.target
        inputs = TreeInputs.of([chain_tree(self.anchor, [self.anchor] * (n - 1))] * rows)
        ids = target.ids(inputs.ids.tolist())
        start = time.perf_counter()
        # (one token is the plain step, which a cycle runs without the tree's mask: priced as a tree's, a first node
        # looked free beside it, and a drafter never right verified one every probe)
        logits, _ = target.forward(ids, last_only=False, tree=inputs if n > 1 else None)
        target.to_host(target.sample(logits, self.engine.rows, ids, self.engine.row_sampling))
        seconds = time.perf_counter() - start
        target.keep([0] * rows, n)
        return seconds

    def draft(self, rows: int = 1, block: int | None = None) -> float:
        start = time.perf_counter()
        out = self.drafter.propose(self.target.ids([[self.anchor]] * rows), None, block or self.engine.block_size,
                                   MAX_TOP_K)
        self.target.to_host(out.top_ids)
        return time.perf_counter() - start


def settled(fn, tries: int = 8) -> None:
    """Call fn until it runs at its speed: a compiled target's first forward of a shape compiles it (seconds), and
    the next few may wait on the compiler's threads; the cost is what comes after."""
    fastest = fn()
    for _ in range(tries):
        seconds = fn()
        if seconds <= 1.5 * fastest:
            return
        fastest = min(fastest, seconds)


def rounds(points: dict, first: dict[str, float], budget: float = ROUNDS_SECONDS) -> dict[str, float]:
    """The median per point of its `first` timing and of further interleaved rounds: as many rounds in all as take
    `budget` seconds (one round: the first timings' sum), at most MAX_ROUNDS, at least the first. points: name -> a
    function that times it once."""
    samples = {k: [t] for k, t in first.items()}
    one = sum(first.values())
    total = min(int(budget / one), MAX_ROUNDS) if one > 0 else MAX_ROUNDS
    for _ in range(total - 1):
        for name, fn in points.items():
            samples[name].append(fn())
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(engine, max_tokens: int = 257) -> Costs:
    """The profile after CONTEXT cached positions, and a plain step, a block's verify and a draft after
    LONGER_CONTEXT (where the target's context allows): the planner interpolates between the two for the rows' real
    lengths."""
    costs = measure_at(engine, fitting(engine, CONTEXT), max_tokens, full=True)
    longer = fitting(engine, LONGER_CONTEXT)
    if longer > costs.context:
        costs.longer = measure_at(engine, longer, min(max_tokens, engine.block_size), full=False)
    engine.reset()
    return costs


def measure_at(engine, context: int, max_tokens: int = 257, full: bool = True) -> Costs:
    """Seconds of one draft forward and of a target forward of n tokens after `context` positions, for n on GRID up
    to max_tokens, stopping once n tokens cost 4 plain steps and n covers a block (beyond that no tree pays on this
    device); with `full`, batches of BATCH_ROWS rows at BATCH_TOKENS tokens each and draft forwards of DRAFT_BLOCKS
    positions too (without: one row's plain step, block verify and draft, for the longer context). The first timing of each
    point walks the grid; the rest are interleaved rounds, and each point is the median."""
    drafter, block = engine.drafter, engine.block_size
    compiles = engine.target.capabilities.compiles
    note(f"prefilling {context} positions")
    probe = Probe(engine, context)
    points, first = {}, {}

    def timed(name: str, fn, rows: int = 1) -> float:
        note(f"{describe(name)}{f' in each of {rows} rows' if rows > 1 else ''} after {context} positions")
        if compiles:
            settled(fn)
        points[name], first[name] = fn, fn()  # (a first call slowed by allocation is outvoted by the rounds)
        return first[name]

    note(f"a warm-up step after {context} positions")
    probe.verify(1)  # (warm-up)
    plain = 0.0
    room = (engine.max_context or context + max_tokens) - context  # (the forwards must fit after the context)
    max_tokens = max(min(max_tokens, room), 1)
    grid = [g for g in GRID if g <= max_tokens] if full else sorted({1, min(block, max_tokens)})
    for n in grid:
        seconds = timed(f"v{n}", lambda n=n: probe.verify(n))
        plain = plain or seconds
        if seconds > 4 * plain and n >= block:
            break
    singles = [int(k[1:]) for k in points]
    if drafter is not None:
        timed("d", probe.draft)
        for b in (b for b in DRAFT_BLOCKS if b < block and full):
            timed(f"b{b}", lambda b=b: probe.draft(1, b))
    note(f"timing every point again after {context} positions, up to {MAX_ROUNDS} rounds, for its median")
    medians = rounds(points, first)
    verify = monotone([(n, medians[f"v{n}"]) for n in singles])
    draft = medians.get("d", 0.0)
    blocks = {b: {1: medians[f"b{b}"]} for b in DRAFT_BLOCKS if f"b{b}" in medians}
    batch, draft_batch = {}, {}
    if full and engine.target.capabilities.batches:
        tokens = [t for t in BATCH_TOKENS if t <= min(block, verify[-1][0])]
        held = 0
        for rows in sorted(BATCH_ROWS, reverse=True):  # (one batch prefilled, then rows retired: prefills dominate)
            if interpolate(verify, rows * tokens[-1]) > BATCH_SECONDS:
                continue  # (a device slow at this many tokens in one row pays for every token: r rows of n tokens
                # cost one row of r * n, which is what the profile assumes without batch points)
            if held:
                engine.retire(list(range(rows, held)))
            else:
                probe.rows(rows)
            held, points, first = rows, {}, {}
            for t in tokens:
                timed(f"v{t}", lambda t=t, rows=rows: probe.verify(t, rows), rows)
            if drafter is not None:
                timed("d", lambda rows=rows: probe.draft(rows), rows)
            medians = rounds(points, first)
            batch[rows] = monotone([(t, medians[f"v{t}"]) for t in tokens])
            if drafter is not None:
                draft_batch[rows] = medians["d"]
    engine.reset()
    if blocks:
        blocks[block] = {1: draft}
    return Costs(draft, verify, batch, draft_batch, context, draft_blocks=blocks)


def describe(point: str) -> str:
    """A profile point's name in words: v16 -> a verify of 16 tokens, d -> a draft, b4 -> a draft of 4 positions."""
    if point == "d":
        return "a draft forward"
    n = int(point[1:])
    if point[0] == "b":
        return f"a draft forward of {n} positions"
    return "a plain step" if n == 1 else f"a verify of {n} tokens"


def monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """More tokens never cost less: each point at least the one before (a median below it is noise)."""
    out: list[tuple[int, float]] = []
    for n, t in points:
        out.append((n, max(t, out[-1][1] if out else 0.0)))
    return out
