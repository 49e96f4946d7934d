"""The one speculative engine: per-row state over a backend's Target and Drafter (dflash/core/contract.py).

The engine keeps what the caches hold and moves them: every row's committed tokens (whose K/V is in the target
cache) and settings (rows.py), the target features the drafter has not read yet (rows.PendingFeatures), prefix reuse and
chunked prefill, and a cycle's operations: draft(anchors) -> Draft (the drafter's block of B positions after each
row's anchor, from the pending features), verify(draft) -> Verified (the target's own token at each position, in one
forward and one device -> host read), commit(verified, keeps) (row i keeps its first keeps[i] positions; the cache
forgets the rest). dflash/core/cycle.py runs a cycle through them as the policy (policy.py) plans it. A batch of one
and a batch of N are the same code; a running batch admits a row (its prefill) and retires rows between cycles.
"""

from __future__ import annotations

from typing import Sequence

from .admission import Prefill
from .budget import BATCH_PAUSE, ITL_LIMIT
from .cycle import CycleClock, chain_cycle, run_cycle
from .contract import Capabilities, Draft, Drafter, Pending, Step, Target, Verified
from .cycle_times import CycleTimes
from .errors import DFlashError
from .lookahead import Lookahead, lands
from .prefix_cache import PrefixCache, keep_row
from .rows import PendingFeatures, Row
from .sampling import RowDraw, RowSampling, SamplingParams, common_prefix, host_logprobs, row_draws
from .tree import TreeInputs
from .policy import Policy

# features pending past which a cycle without a draft forward hands them to the drafter's context (the work the next
# draft would do), which bounds what waits; a pause lasts at most BATCH_PAUSE cycles, so its features are read once
PENDING_ABSORB = BATCH_PAUSE


class Engine(Prefill):
    """Speaks the batch protocol dflash.core.loop drives (prefill / draft / verify / commit / retire) for one row or
    many, plus the single-sequence operations a chat needs (crop, reset, cached_tokens)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *, block_size: int = 1,
                 prefill_chunk: int = 2048, name: str = ""):
        self.target, self.drafter = target, drafter  # a backend's primitives (contract.py)
        self.name = name
        self.block_size = block_size if drafter is not None else 1
        self.prefill_chunk = prefill_chunk
        self.max_context = target.max_context
        self.info = target.info
        self.batch: list[Row] = []  # per row, in the caches' row order: everything the core keeps of it (rows.py)
        self.shared = False  # rows share the caches (a batch was admitted): no prefix reuse until reset
        self.queue = PendingFeatures()  # target features the drafter has not read yet (see `pending`)
        self.sampling = SamplingParams()  # the settings of rows admitted without their own
        self.logprobs: int | None = None  # None: off; k >= 0: every sample also returns log-probs (top k)
        self.first_logprobs: tuple[list[float], list[list[tuple[int, float]]]] | None = None  # last prefill's
        self.prefix_cache: PrefixCache | None = None  # finished rows' caches, for later prompts (enable_prefix_cache)
        self.last_reused = 0  # prompt tokens the last prefill found in the caches
        self.policy = Policy()  # what each cycle runs (set_verify)
        self.lookahead = Lookahead()  # a plain step issued ahead of the host (lazy targets)
        self.clock = CycleClock()  # each cycle's own wall time (the policy learns from it)

    # ---- what the caches hold ------------------------------------------------------------------------------------
    @property
    def rows(self) -> list[list[int]]:
        """Per row: the ids whose K/V is in the target cache."""
        return [row.tokens for row in self.batch]

    @property
    def row_sampling(self) -> list[RowSampling]:
        """Per row: its settings, acceptance rule and noise seed."""
        return [row.sampling for row in self.batch]

    @property
    def tokens(self) -> list[int]:
        """Row 0's cached ids (the single-sequence view)."""
        return self.batch[0].tokens if self.batch else []

    @property
    def cached_tokens(self) -> list[int]:
        return self.tokens

    @property
    def pending(self) -> Pending | None:
        """The target features the drafter has not read yet, as one Pending (joined now if cycles left parts)."""
        return self.queue.peek(self.target)

    @property
    def capabilities(self) -> Capabilities:
        """What this engine's target can do (batches, trees), as its backend declares."""
        return self.target.capabilities

    def set_sampling(self, params: SamplingParams) -> None:
        """The sampling settings of the next lone row (and of rows admitted without their own)."""
        self.sampling = params

    @property
    def accept_rules(self) -> list[str]:
        """Each row's acceptance rule (dflash.core.sampling: greedy, match, rejection, ..., multi)."""
        return [r.rule for r in self.row_sampling]

    def set_verify(self, mode: str = "chain", budget: int | None = None, times: CycleTimes | None = None,
                   copy_branch: bool = True, itl_limit: float | None = ITL_LIMIT) -> None:
        """chain, tree or auto verification (dflash.core.policy.Policy.choose)."""
        self.policy = Policy.choose(mode, self.block_size, self.drafter, self.capabilities, budget, times,
                                    copy_branch, itl_limit)

    @property
    def verify_mode(self) -> str:
        return self.policy.mode

    @property
    def verify_note(self) -> str:
        return self.policy.note

    def enable_prefix_cache(self, max_bytes: int) -> None:
        """Keep finished rows' caches (at most max_bytes, least recently used out) for prompts that share their
        prefix; one line if this target's rows cannot be kept apart."""
        if not self.capabilities.batches:
            raise DFlashError(self.capabilities.batch_refusal)
        self.prefix_cache = PrefixCache(max_bytes) if max_bytes > 0 else None

    def spawn(self) -> Engine:
        """An engine on the same models with empty caches (a joining row's)."""
        return Engine(self.target.spawn(), self.drafter.spawn() if self.drafter else None,
                      block_size=self.block_size, prefill_chunk=self.prefill_chunk)

    @lands
    def keep_prefix(self, i: int) -> None:
        """Row i's caches, copied out, go to the prefix cache (if one is on) for later prompts."""
        if self.prefix_cache is not None:
            row = Engine(self.target.extract(i), self.drafter.extract(i) if self.drafter else None,
                         block_size=self.block_size, prefill_chunk=self.prefill_chunk)
            row.batch = [Row(list(self.batch[i].tokens), self.batch[i].sampling)]
            keep_row(self.prefix_cache, row)

    # ---- the cycle -------------------------------------------------------------------------------------------------
    def step(self, anchors: Sequence[int]) -> list[Step]:
        """One speculative cycle for every row (draft -> verify -> accept -> commit, or a tree's: set_verify); row
        i's anchor is its last committed token. A lazy target's plain steps run one ahead (dflash/core/lookahead.py)."""
        if self.drafter is None and self.lookahead.runs(self):
            return self.lookahead.step(self, anchors)
        return run_cycle(self, anchors, self.policy)

    def plain_step(self, anchors: Sequence[int], again: bool = False) -> list[Step]:
        """A cycle without a draft forward: each row's target token after its anchor. `again`: the next cycle pauses
        too, so a lazy target runs it ahead (dflash/core/lookahead.py); the features wait for the next draft."""
        if self.lookahead.runs(self):
            return self.lookahead.step(self, anchors, again)
        return chain_cycle(self, anchors, length=0)

    @lands
    def verify_tree(self, ids, tree: TreeInputs):
        """The target's logits and features for every row's tree of nodes (a tree cycle's verify forward)."""
        return self.target.forward(ids, last_only=False, tree=tree)

    @property
    def drafts_some_rows(self) -> bool:  # (draft(rows=...))
        return self.drafter is not None and self.drafter.drafts_some_rows

    def draft(self, anchors: Sequence[int], top_k: int = 0, draws: list[RowDraw] | None = None,
              block: int | None = None, rows: list[int] | None = None) -> Draft:
        """Each row's block [anchor, proposals] of `block` positions (default: the block size; the anchor alone
        without a drafter), from the features pending. `rows` (greedy rows, drafts_some_rows): those rows' blocks
        only, in that order; every row's pending features go into the drafter's context all the same. The target's
        cache is not read: a step issued ahead stays (a probe whose plan gives no node takes it)."""
        if self.drafter is None:
            return Draft(self.target.ids([[a] for a in anchors]))
        pending = self.take_pending()
        if rows is not None:
            self.drafter.extend(pending)
            pending, anchors = None, [anchors[r] for r in rows]
        anchor_ids = self.target.ids([[a] for a in anchors])
        return self.drafter.propose(anchor_ids, pending, block or self.block_size, top_k, draws, rows=rows)

    @lands
    def verify(self, draft: Draft, draws: list[RowDraw] | None = None) -> Verified:
        """The target's token at every position of each row's block, in one forward, under the row's rule: its own
        draw (greedy, match), or, for a row verifying by rejection (any proposal shape), the draft token where
        rejection sampling accepts it and the residual's draw where it does not (so the longest agreeing prefix is
        the accepted one either way)."""
        logits, features = self.target.forward(draft.ids, last_only=False)
        tokens, logprobs = self.sample(logits, draft.ids, draws=draws, draft=draft)
        rows = self.target.to_host(self.target.cat([draft.ids, tokens]))  # the cycle's one device -> host read
        width = len(rows[0]) // 2
        chosen, top = logprobs if logprobs is not None else (None, None)
        return Verified([r[:width] for r in rows], [r[width:] for r in rows], features, chosen, top)

    def commit(self, verified: Verified, keeps: Sequence[int]) -> None:
        """Row i keeps its first keeps[i] verified positions; their features become the drafter's pending context."""
        keeps = list(keeps)
        if not self.target.keep(keeps, len(verified.blocks[0])):
            raise AssertionError("a verified block can always be rewound")  # within the last forward
        for row, block, k in zip(self.rows, verified.blocks, keeps):
            row.extend(block[:k])
        if self.drafter is None:
            return
        most, features = max(keeps), verified.features
        self._queue_pending(Pending(features if most == len(verified.blocks[0]) else self.target.head(features, most),
                                    keeps))

    def commit_slots(self, slots: list[list[int]], width: int, committed: list[list[int]], features) -> None:
        """A tree cycle's commit: row i keeps slots[i] of the last forward's `width` (their tokens committed[i], the
        anchor first), and their features become the drafter's pending context."""
        self.target.keep_slots(slots, width)
        for row, ids in zip(self.rows, committed):
            row.extend(ids)
        if features is not None:  # (None: a drafter that reads no target features)
            self._queue_pending(Pending(self.target.gather(features, slots), [len(s) for s in slots]))

    def _queue_pending(self, new: Pending) -> None:
        """A cycle's committed features wait for the drafter. After a cycle without a draft forward (a plain step, or
        copied nodes alone) they wait behind the earlier pending ones, unjoined: the next draft takes them all in one
        forward, so such a cycle costs no drafter forward of its own (PENDING_ABSORB of them go to the drafter's
        context at once)."""
        self.queue.add(new)
        if max(self.queue.counts) >= PENDING_ABSORB:
            assert self.drafter is not None  # (features pend for a drafter only)
            self.absorb_pending()

    @lands
    def retire(self, rows: Sequence[int]) -> None:
        """Drop finished rows (indices into the current rows) from every cache."""
        gone = set(rows)
        keep = [i for i in range(len(self.batch)) if i not in gone]
        if not keep and not self.shared:
            return  # a finished single sequence stays cached: the next prompt may reuse its prefix (a chat)
        for i in sorted(gone):
            self.keep_prefix(i)
        if not keep:
            self.reset()
            return
        self.target.select(keep)
        if self.drafter is not None:
            self.drafter.select(keep)
            self.queue.select(keep, self.target)
        self.batch = [self.batch[i] for i in keep]

    # ---- single sequence: rewind and reset ---------------------------------------------------------------------------
    @lands
    def crop(self, length: int) -> None:
        """Forget every cached position from `length` on (target and drafter)."""
        if len(self.batch) > 1:
            raise DFlashError("crop: a batch of rows is not cropped; retire rows instead")
        drop = len(self.tokens) - length
        if drop > 0:
            if not self.target.trim(drop):
                # sliding-window / recurrent state cannot go back past the last forward: start over (the next
                # prefill feeds the whole prompt again)
                self.reset()
                return
            del self.tokens[length:]
        if self.drafter is None:
            return
        position = self.drafter.position
        if length >= position:
            self.queue.crop(length - position, self.target)
            return
        self.queue.set(None)
        if not self.drafter.crop(length):
            self.reset()  # the window dropped what we need: rebuild the whole context from scratch

    @lands
    def reset(self) -> None:
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.batch, self.shared = [], False
        self.queue.set(None)
        self.policy.reset()

    def close(self) -> None:
        self.target.close()

    # ---- what a cycle draws and reads (dflash/core/cycle.py) ---------------------------------------------------
    def row_draws(self, width: int, offset: int = 1, noise: int | None = None) -> list[RowDraw] | None:
        """Each row's draws for the positions n + offset .. n + offset + width - 1 (dflash.core.sampling.row_draws);
        None when every row is greedy."""
        return row_draws(self.rows, self.row_sampling, lambda keys: self.target.gumbel(keys), width, offset, noise)

    def sample(self, logits, block, paths=None, draws=None, draft=None):
        """Each row's tokens drawn from `logits` after its committed tokens + block (a tree: + paths) under its own
        settings (Target.sample); (tokens, None), or with self.logprobs set (tokens, (chosen, tops)): per row and
        position the chosen token's log-probability and its top (id, log-probability) pairs, on the host."""
        out = self.target.sample(logits, self.rows, block, self.row_sampling, paths, self.logprobs, draws, draft)
        if self.logprobs is None:
            return out, None
        tokens, arrays = out
        return tokens, host_logprobs(*(self.target.to_host(x) for x in arrays))

    def take_pending(self) -> Pending | None:
        """Every target feature the drafter has not read, for the next draft; none pending after."""
        return self.queue.take(self.target)

    def absorb_pending(self) -> None:
        """The drafter reads every pending feature into its context now (no draft)."""
        assert self.drafter is not None  # (features pend for a drafter only)
        self.drafter.extend(self.take_pending())
