"""python -m dflash.bench load-sim: what `--verify auto` chooses for a whole batch at concurrency 1..32, on a roofline
model of a GPU (no GPU needed, deterministic).

A forward of T tokens over r rows costs max(weights / bandwidth, 2 * parameters * T / compute) plus reading every
row's K/V, plus a fixed cost per forward (`--launch-ms`: 2 ms for eager forwards; a CUDA graph's replay costs a
fraction of it): flat in T until the compute knee (a few hundred tokens on an H200 for an 8B model), then linear.
The drafter (5 Qwen3-8B-shaped layers and the target's LM head on its positions) costs the same way. The engine's own
planner (dflash.core.budget.TreePlanner: path choice, node counts, draft block, pauses, rows out of the draft forward)
runs cycle after cycle, each cycle's seconds taken from the roofline and learnt by its cycle times as a device's
would be (dflash/core/cycle_times.py, from nothing), against a plain batched step and against the fixed chain.

The drafter is synthetic: at every depth its most probable token is the target's with probability 0.86 and each next
rank with half the previous one's probability, which gives the chain tau 6.5 at block 16 (the DFlash paper's
Qwen3-8B greedy figure); `--hard F` gives a fraction of the rows a drafter that is rarely right (top-1 0.05). The
target's tokens are drawn from those same probabilities (seeded), so the planner's calibration meets a calibrated
drafter. Real acceptance differs per prompt; the point is the shape: wide trees at low load, narrower ones as the
batch reaches the compute knee, never a loss to the plain step.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace

from .. import cli
from ..core.budget import AUTO_BUDGET, Pause, TreePlanner
from ..core.cycle_times import CycleTimes

CONCURRENCY = (1, 2, 4, 8, 16, 32)
CYCLES = 400  # per batch and mode; the second half is reported


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


@dataclass(frozen=True)
class Roofline:
    """A cycle's seconds on `device` for `shape` after `context` cached positions per row."""

    device: Device = H200
    shape: Shape = QWEN3_8B
    block_size: int = 16
    context: int = 1024

    def cycle(self, tokens: int, rows: int, drafted: bool = True, block: int | None = None,
              draft_rows: int | None = None) -> float:
        kv = self.shape.kv_bytes_per_token * self.context
        seconds = forward_seconds(self.device, self.shape.target_params, rows * tokens, rows * kv)
        if drafted:
            positions = (draft_rows or rows) * ((block or self.block_size) - 1)
            seconds += forward_seconds(self.device, self.shape.draft_params + self.shape.head_params, positions)
        return seconds


def synthetic_draft(top1: float, positions: int, k: int = 8) -> tuple[list[list[int]], list[list[float]]]:
    """Per depth: token ids and probabilities of the top k (rank r: top1 * 2**-r of the rest, below 1 in all)."""
    probs = [top1] + [(1 - top1) / 2 ** r for r in range(1, k)]
    return [list(range(k))] * positions, [probs] * positions


@dataclass(frozen=True)
class Rows:
    """A batch: `rows` rows, the first `hard` of them with a drafter that is rarely right (top-1 HARD_TOP1)."""

    rows: int
    hard: int = 0

    def top1(self, row: int) -> float:
        return HARD_TOP1 if row < self.hard else GOOD_TOP1


GOOD_TOP1 = 0.86  # the chain's tau is then 6.5 at block 16 (the DFlash paper's Qwen3-8B greedy figure)
HARD_TOP1 = 0.05  # a row whose text the drafter does not know


class Target:
    """The target's token at every depth of one cycle, drawn from the synthetic draft's own distribution (the
    drafter is calibrated by construction); -1 stands for a token outside its top k."""

    def __init__(self, seed: int, k: int = 8):
        self.rng, self.k = random.Random(seed), k

    def tokens(self, top1: float, depths: int) -> list[int]:
        _, (probs,) = synthetic_draft(top1, 1, self.k)
        return self.rng.choices([*range(self.k), -1], [*probs, 1 - sum(probs)], k=depths)


def run(batch: Rows, costs: Roofline, mode: str = "auto", cycles: int = CYCLES, block_size: int = 16,
        seed: int = 0) -> dict:
    """`cycles` cycles of one batch under dflash.core.budget's own planner (`auto`) or the fixed chain, each cycle's
    seconds the roofline's (the planner's cycle times learn them from nothing, as they would a device's), acceptance
    drawn from the synthetic drafter. The second half of the cycles is reported (the first lets the calibration and
    the cycle times settle)."""
    planner = TreePlanner("auto", block_size, AUTO_BUDGET, CycleTimes(block_size), copy_branch=False)
    target, rows = Target(seed), batch.rows
    pauses = [Pause() for _ in range(rows)]  # (each row's own pause from the draft forward)
    tokens = [0] * rows
    seconds = nodes = drafted = draft_rows = 0.0
    chain_cycles = 0
    for cycle in range(cycles):
        truth = [target.tokens(batch.top1(r), block_size - 1) for r in range(rows)]
        path = "chain" if mode == "chain" else planner.path(pauses)
        if path == "chain":
            accepted = [next((d for d, t in enumerate(row) if t != 0), block_size - 1) for row in truth]
            took = costs.cycle(block_size, rows, True)
            planner.observe_chain(rows, took)
            verified, drafting_rows, was_drafted = block_size - 1, rows, True
        else:
            accepted, took, verified, drafting_rows, was_drafted = _tree_cycle(planner, batch, truth, costs, pauses)
        if cycle >= cycles // 2:
            tokens = [t + a + 1 for t, a in zip(tokens, accepted)]
            seconds += took
            nodes += verified
            drafted += was_drafted
            draft_rows += drafting_rows
            chain_cycles += path == "chain"
    counted = cycles - cycles // 2
    plain = rows / costs.cycle(1, rows, False)
    rate = sum(tokens) / seconds
    return {"concurrency": rows, "hard_rows": batch.hard, "mode": mode, "speedup": rate / plain,
            "tokens": sum(tokens) / rows / counted, "cycle_ms": 1e3 * seconds / counted,
            "nodes": nodes / counted, "drafted": drafted / counted, "draft_rows": draft_rows / max(drafted, 1),
            "chain_path": chain_cycles / counted, "block": planner.draft_block}


def _tree_cycle(planner: TreePlanner, batch: Rows, truth: list[list[int]], costs: Roofline,
                pauses: list[Pause]):
    """dflash.core.cycle.tree_cycle's control flow on synthetic drafts: (accepted per row, seconds, nodes per row,
    drafting rows, drafted)."""
    rows, anchors = batch.rows, [0] * batch.rows
    drafts = planner.drafts_this_cycle()
    drafting = planner.drafting_rows(pauses) if drafts else None
    if drafting == []:
        drafts = False
    if not drafts:  # a pause (nothing is copied here): the plain step
        took = costs.cycle(1, rows, False)
        planner.observe_plain(rows, took)
        return [0] * rows, took, 0, 0, False
    chosen = drafting if drafting is not None else list(range(rows))
    drafts_of = [synthetic_draft(batch.top1(r), planner.draft_block - 1) for r in chosen]
    plan = planner.plan(anchors, [d[0] for d in drafts_of], [d[1] for d in drafts_of], (), drafting, pauses)
    width = max(len(t.tokens) for t in plan.trees)
    took = costs.cycle(width, rows, True, plan.block, plan.draft_rows)
    # the target's token after node i is the one drawn at the next depth (independent of the path: synthetic)
    paths = [tree.walk([row[d] if d < len(row) else -1 for d in tree.depths])[0]
             for tree, row in zip(plan.trees, truth)]
    planner.observe(plan, paths, took)
    return [len(p) for p in paths], took, width - 1, len(chosen), True


def simulate(concurrency=CONCURRENCY, device: Device = H200, shape: Shape = QWEN3_8B, hard: float = 0.0,
             cycles: int = CYCLES, seed: int = 0) -> list[dict]:
    """auto and the fixed chain at each concurrency, a fraction `hard` of the rows with a drafter rarely right, the
    acceptance drawn from `seed`."""
    out = []
    for rows in concurrency:  # (each run learns its cycle times from its own cycles)
        batch = Rows(rows, round(hard * rows))
        chain = run(batch, Roofline(device, shape), "chain", cycles, seed=seed)
        out.append(run(batch, Roofline(device, shape), "auto", cycles, seed=seed) | {"chain_speedup": chain["speedup"]})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| concurrency | rows rarely right | cycles drafted | rows per draft forward | draft block | "
             "verified per row | tokens per row and cycle | cycle (ms) | auto speedup | chain speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['hard_rows']} | {100 * r['drafted']:.0f}% | {r['draft_rows']:.1f} | "
                     f"{r['block']} | {r['nodes']:.1f} | {r['tokens']:.2f} | {r['cycle_ms']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['chain_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m dflash.bench load-sim", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    p.add_argument("--hard", type=float, default=0.0,
                   help="fraction of each batch's rows whose drafter is rarely right (top-1 %.2f)" % HARD_TOP1)
    p.add_argument("--launch-ms", type=float, default=H200.launch * 1e3,
                   help="fixed milliseconds per forward (2: eager; a CUDA graph's replay costs a fraction of it)")
    p.add_argument("--cycles", type=int, default=CYCLES)
    p.add_argument("--seed", type=int, default=0, help="the draws of the synthetic drafter's acceptance")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = p.parse_args(argv)
    if not 0.0 <= args.hard <= 1.0:
        p.error(f"--hard: got {args.hard}, expected a fraction in [0, 1]")
    if args.launch_ms < 0 or args.cycles < 2:
        p.error("--launch-ms: expected >= 0; --cycles: expected >= 2")
    device = replace(H200, name=f"H200-like (4.8 TB/s, 600 TFLOP/s achievable bf16, {args.launch_ms:g} ms per "
                     "forward fixed)", launch=args.launch_ms / 1e3)
    rows = simulate(args.concurrency, device, hard=args.hard, cycles=args.cycles, seed=args.seed)
    print(json.dumps(rows, indent=2) if args.json else f"{device.name}, Qwen3-8B shape, block 16\n\n"
          + markdown(rows))
    return 0
