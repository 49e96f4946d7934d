"""What a draft and a verify cost on this device, measured once per model shape + device + dtype and cached.

`--verify auto` needs T_draft(rows) and T_verify(rows, n) in seconds: on an H200 a verify is nearly flat up to
hundreds of tokens, on a 2-core CPU it grows with every token, and a batch of rows costs a GPU little more than one
row below its compute knee and a CPU every row's tokens; the budget rule (dflash/core/budget.py) has to know which. The
profile runs the engine's own primitives (the tree forward, the draft) after a short context, one row at up to 512
tokens, then batches of 4 and 16 rows at up to a block's tokens each, so it measures exactly what the cycles will
run; it takes about a second for a small model and is then read from
$DFLASH_CACHE_DIR/costs/ (default ~/.cache/dflash/costs/).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from .budget import MAX_TOP_K, Costs
from .errors import DFlashError
from .io import cache_root
from .tree import TreeInputs, chain_tree

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
BATCH_ROWS = (4, 16, 32)  # batches measured too (where the backend batches): rows ... (32: if 16 rows are cheap)
BATCH_TOKENS = (1, 2, 4, 8, 16)  # ... times tokens per row (at most the block, and what the single-row grid reached)
DRAFT_BLOCKS = (2, 4, 8)  # shorter draft forwards measured too (auto drafts fewer positions where depth does not pay)
CONTEXT = 64  # positions before the measured forwards ...
LONGER_CONTEXT = 320  # ... and again after these (a serving load's rows: prompt + answer)
WIDE_BATCH_SECONDS = 0.25  # 32 rows are measured when a block of 16 rows costs less
NOTICE_SECONDS = 1.0  # a profile that takes longer says so in one line


# the engine code whose speed a profile measured: bumped when a forward gets faster, so cached profiles are measured
# anew (as a new grid, shape or device is)
PROFILE_VERSION = 2


def cache_dir() -> Path:
    return cache_root() / "costs"


def cost_key(engine) -> str:
    """Costs depend on shapes, backend, device, dtype and threads, not on the weights' values."""
    info, spec = engine.info, getattr(engine.drafter, "spec", None)
    parts = [PROFILE_VERSION, BATCH_ROWS, BATCH_TOKENS, DRAFT_BLOCKS, CONTEXT, LONGER_CONTEXT, engine.name,
             info.model_type, info.hidden_size, info.num_hidden_layers, info.vocab_size,
             engine.block_size, engine.target.device_key()]
    if spec is not None:
        parts += [spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_context_layers]
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def measured_costs(engine, max_tokens: int = 257, use_cache: bool = True) -> Costs:
    """The engine's costs, from the cache or measured now (the engine is reset either way)."""
    path = cache_dir() / f"{cost_key(engine)}.json"
    if use_cache and path.exists():
        try:
            costs = Costs.from_json(json.loads(path.read_text()))
            covered = costs.verify[-1][0] >= max(g for g in GRID if g <= max(max_tokens, 1))
            if covered or costs.verify[-1][1] > 4 * costs.verify[0][1]:  # (measuring stopped there last time)
                return costs
        except (ValueError, KeyError, TypeError, IndexError):
            pass  # a damaged cache file is measured again
    start = time.perf_counter()
    costs = measure(engine, max_tokens)
    seconds = time.perf_counter() - start
    if use_cache and seconds > NOTICE_SECONDS:  # say why this first load took longer
        print(f"dflash: measured this device's draft and verify costs for --verify auto in {seconds:.1f} s "
              f"(once: cached in {path.parent})", file=sys.stderr, flush=True)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(costs.to_json() | {"device": engine.target.device_key()}))
        tmp.replace(path)
    return costs


def measure(engine, max_tokens: int = 257, repeats: int = 5) -> Costs:
    """The profile after CONTEXT cached positions, and again after LONGER_CONTEXT (where the target's context
    allows): the planner interpolates between the two for the rows' real lengths."""
    costs = measure_at(engine, CONTEXT, max_tokens, repeats, draft_blocks=True)
    longer = min(LONGER_CONTEXT, (engine.max_context or LONGER_CONTEXT * 2) // 2)
    if longer > CONTEXT:
        costs.longer = measure_at(engine, longer, min(max_tokens, costs.verify[-1][0]), repeats)
    return costs


def measure_at(engine, context: int, max_tokens: int = 257, repeats: int = 5, draft_blocks: bool = False) -> Costs:
    """Seconds of one draft forward and of a target forward of n tokens (a chain-shaped tree: the tree path's own
    mask and positions) after `context` positions, for n on GRID up to max_tokens, stopping once n tokens cost 4
    single-token steps and n covers a block (beyond that no tree pays on this device); then the same for batches of
    BATCH_ROWS rows; with `draft_blocks`, draft forwards of DRAFT_BLOCKS positions at every measured row count too.
    Each is the fastest of up to `repeats` timings: the cost without interference (other load
    shows in the planner's online clock instead); forwards slower than 20 ms are timed fewer times, so a large model
    on a CPU profiles in seconds, not minutes."""
    target, drafter = engine.target, engine.drafter
    engine.reset()
    vocab = engine.info.vocab_size
    prompt = [(31 * i + 7) % vocab for i in range(context)]
    engine.prefill([prompt])
    anchor = prompt[-1]

    def verify_once(n: int, rows: int = 1) -> float:
        inputs = TreeInputs.of([chain_tree(anchor, [anchor] * (n - 1))] * rows)
        ids = target.ids(inputs.ids.tolist())
        start = time.perf_counter()
        logits, _ = target.forward(ids, last_only=False, tree=inputs)
        target.to_host(target.sample(logits, engine.rows, ids))
        seconds = time.perf_counter() - start
        target.keep([0] * rows, n)
        return seconds

    def draft_once(rows: int = 1, block: int = engine.block_size) -> float:
        start = time.perf_counter()
        out = drafter.propose(target.ids([[anchor]] * rows), None, block, MAX_TOP_K)
        target.to_host(out.top_ids)
        return time.perf_counter() - start

    def times(first: float) -> int:
        return repeats if first < 0.02 else max(1, min(repeats, 2 if first < 0.2 else 1))

    def fastest(fn, *args) -> float:
        first = fn(*args)  # also the warm-up (allocation, kernel selection)
        return min(fn(*args) for _ in range(times(first)))

    verify = []
    for n in (g for g in GRID if g <= max_tokens):
        seconds = fastest(verify_once, n)
        verify.append((n, max(seconds, verify[-1][1] if verify else 0.0)))  # more tokens never cost less
        if seconds > 4 * verify[0][1] and n >= engine.block_size:
            break
    draft = fastest(draft_once) if drafter is not None else 0.0
    shorter = [b for b in DRAFT_BLOCKS if b < engine.block_size] if draft_blocks and drafter is not None else []
    blocks = {b: {1: fastest(draft_once, 1, b)} for b in shorter}
    batch, draft_batch = {}, {}
    if batchable(target):
        widest = min(engine.block_size, verify[-1][0])
        for rows in BATCH_ROWS:
            if rows > 16 and batch[16][-1][1] > WIDE_BATCH_SECONDS:
                break  # (a large model on a CPU: 32 rows are extrapolated from 4 and 16)
            engine.prefill([prompt] * rows)
            points = []
            for n in (t for t in BATCH_TOKENS if t <= widest):
                points.append((n, max(fastest(verify_once, n, rows), points[-1][1] if points else 0.0)))
            batch[rows] = points
            if drafter is not None:
                draft_batch[rows] = fastest(draft_once, rows)
            for b in shorter:
                blocks[b][rows] = fastest(draft_once, rows, b)
    engine.reset()
    if blocks:
        blocks[engine.block_size] = {1: draft, **draft_batch}
    return Costs(draft, verify, batch, draft_batch, context, draft_blocks=blocks)


def batchable(target) -> bool:
    return target.capabilities.batches  # (a backend or target that runs one row: no batch points)
