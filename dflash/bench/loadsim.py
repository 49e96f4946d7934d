"""python -m dflash.bench load-sim: what `--verify auto` would choose for a whole batch at concurrency 1..32, on a
roofline model of a GPU (no GPU needed, deterministic).

A forward of T tokens over r rows costs max(weights / bandwidth, 2 * parameters * T / compute) plus reading every
row's K/V, plus a fixed launch cost: flat in T until the compute knee (a few hundred tokens on an H200 for an 8B
model), then linear. The drafter (5 Qwen3-8B-shaped layers and the target's LM head on its B-1 positions) costs the
same way. Those costs fill a `Costs` with the grid dflash.core.costs measures on a real device (one row up to 512 tokens,
batches up to a block per row), and the planner's own rule (dflash.core.tree.best_first + choose_counts, the surrogate
taken as calibrated) picks each row's nodes, against a plain batched step (no draft forward).

The drafter is synthetic: at every depth its most probable token is accepted with probability 0.86 and each next
rank with half the previous one's probability, which gives the chain tau 6.5 at block 16 (the DFlash paper's
Qwen3-8B greedy figure). Real acceptance differs per prompt; the point is the shape: wide trees at low load, narrower
ones as the batch reaches the compute knee, never a loss to the plain step.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from .. import cli
from ..core.cost_model import Costs
from ..core.costs import BATCH_TOKENS, DRAFT_BLOCKS, GRID
from ..core.tree import best_first, choose_counts

CONCURRENCY = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes / s
    compute: float  # achievable bf16 FLOP / s
    launch: float  # seconds of fixed cost per forward (kernels, host)


@dataclass(frozen=True)
class Shape:
    """Parameter and K/V byte counts of a target and its drafter (bf16)."""

    target_params: float
    kv_bytes_per_token: float
    draft_params: float  # the drafter's layers
    head_params: float  # the LM head the drafter shares (run on every block position)


H200 = Device("H200-like (4.8 TB/s, 600 TFLOP/s achievable bf16, 2 ms per forward fixed)", 4.8e12, 6.0e14, 2e-3)
# Qwen3-8B: 36 layers, hidden 4096, 8 K/V heads of 128; a 5-layer drafter of the same layer shape
QWEN3_8B = Shape(target_params=8.2e9, kv_bytes_per_token=36 * 2 * 8 * 128 * 2,
                 draft_params=5 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288), head_params=151936 * 4096)


def forward_seconds(device: Device, params: float, tokens: int, kv_bytes: float = 0.0) -> float:
    memory = (2 * params + kv_bytes) / device.bandwidth
    return device.launch + max(memory, 2 * params * tokens / device.compute)


def roofline_costs(device: Device = H200, shape: Shape = QWEN3_8B, block_size: int = 16, context: int = 1024,
                   rows_grid: tuple[int, ...] = CONCURRENCY[1:]) -> Costs:
    """The grid dflash.core.costs would measure on this device, from the roofline."""
    kv = shape.kv_bytes_per_token * context

    def verify(rows: int, n: int) -> float:
        return forward_seconds(device, shape.target_params, rows * n, rows * kv)

    def draft(rows: int, block: int = block_size) -> float:
        return forward_seconds(device, shape.draft_params + shape.head_params, rows * (block - 1))

    tokens = [t for t in BATCH_TOKENS if t <= block_size]
    blocks = [b for b in DRAFT_BLOCKS if b < block_size] + [block_size]
    return Costs(draft(1), [(n, verify(1, n)) for n in GRID],
                 {r: [(n, verify(r, n)) for n in tokens] for r in rows_grid}, {r: draft(r) for r in rows_grid},
                 draft_blocks={b: {r: draft(r, b) for r in (1, *rows_grid)} for b in blocks})


def synthetic_draft(block_size: int = 16, top1: float = 0.86, k: int = 8):
    """Per depth: token ids and probabilities of the top k (rank r: top1 / 2**r, renormalised below 1)."""
    probs = [top1] + [(1 - top1) / 2 ** r for r in range(1, k)]
    return [list(range(k))] * (block_size - 1), [probs] * (block_size - 1)


def choose(rows: int, costs: Costs, block_size: int = 16, budget: int = 256) -> dict:
    """auto's choice for `rows` identical rows: the draft block (positions its draft forward fills), nodes per row
    (0 and no draft forward: a plain step), expected tokens per row per cycle, cycle seconds, and the speedup over
    a plain batched step."""
    ids, probs = synthetic_draft(block_size)
    candidates = best_first(ids, probs, budget, block_size - 1)
    best: tuple[int, list[float], float, int] | None = None
    for block in sorted(costs.draft_blocks) or [block_size]:
        values = [c.q for c in candidates if len(c.tokens) < block]
        counts, rate = choose_counts([values] * rows, costs.verify_seconds,
                                     costs.draft_seconds(rows, block=block), budget)
        if best is None or rate > best[2]:
            best = (block, values, rate, counts[0])
    assert best is not None  # (at least one block size)
    block, values, rate, nodes = best
    plain = rows / costs.verify_seconds(1, rows)
    if plain >= rate:
        return {"concurrency": rows, "block": 0, "nodes": 0, "draft": False, "tokens": 1.0,
                "cycle_ms": 1e3 * costs.verify_seconds(1, rows), "speedup": 1.0}
    tokens = 1.0 + sum(values[:nodes])
    return {"concurrency": rows, "block": block, "nodes": nodes, "draft": True, "tokens": tokens,
            "cycle_ms": 1e3 * rows * tokens / rate, "speedup": rate / plain}


def chain(rows: int, costs: Costs, block_size: int = 16) -> float:
    """The fixed chain's speedup over a plain batched step at `rows` rows (for comparison)."""
    _, probs = synthetic_draft(block_size)
    tau = 1.0 + sum(probs[0][0] ** d for d in range(1, block_size))
    seconds = costs.draft_seconds(rows) + costs.verify_seconds(block_size, rows)
    return tau * costs.verify_seconds(1, rows) / seconds


def simulate(concurrency=CONCURRENCY, device: Device = H200, shape: Shape = QWEN3_8B) -> list[dict]:
    costs = roofline_costs(device, shape)
    return [choose(c, costs) | {"chain_speedup": chain(c, costs)} for c in concurrency]


def markdown(rows: list[dict]) -> str:
    lines = ["| concurrency | auto: draft block | nodes per row | expected tokens per row and cycle | cycle (ms) | "
             "auto speedup | chain speedup |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        nodes, block = (r["nodes"], r["block"]) if r["draft"] else ("plain step", "-")
        lines.append(f"| {r['concurrency']} | {block} | {nodes} | {r['tokens']:.2f} | {r['cycle_ms']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['chain_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench load-sim", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = p.parse_args(argv)
    rows = simulate(args.concurrency)
    print(json.dumps(rows, indent=2) if args.json else f"{H200.name}, Qwen3-8B shape, block 16\n\n"
          + markdown(rows))
    return 0
