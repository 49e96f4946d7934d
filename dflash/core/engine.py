"""The one speculative engine: per-row state over a backend's Target and Drafter (dflash/core/contract.py).

dflash.core.loop decides what to commit and when to stop; the engine keeps what the caches hold and moves them: the
committed tokens of every row (whose K/V is in the target cache), the target features the drafter has not read yet,
prefix reuse and chunked prefill, and the cycle's arrays (draft -> verify -> commit). A batch of one and a batch of
N are the same code; a running batch admits a row (its prefill) and retires rows between cycles.

One cycle, for block size B and a row with n cached positions; its anchor is the last committed token, not yet fed
to the target, so it sits at position n:

    draft(anchors) -> Draft     the drafter proposes B-1 tokens for positions n+1 .. n+B-1 from the target
                                features of every position before the anchor (the pending ones are appended to
                                its context first)
    verify(draft) -> Verified   the target reads [anchor, proposals] at n .. n+B-1 in one forward and draws its own
                                token at each of the B positions; the cycle's one device -> host read
    commit(verified, keeps)     row i keeps its first keeps[i] verified positions: the target cache forgets the
                                rest, their target features become the drafter's pending context
"""

from __future__ import annotations

import time
from typing import Sequence

from .admission import Admission
from .budget import ITL_LIMIT, MAX_PAUSE, VERIFY_MODES, TreePlanner
from .chain_budget import ChainBudget
from .contract import Capabilities, Draft, Drafter, Pending, Step, Target, Verified
from .cost_model import Costs
from .errors import DFlashError, SettingError
from .pending import PendingFeatures
from .prefix_cache import PrefixCache, keep_row
from .sampling import RowDraw, RowSampling, SamplingParams, accepted_length, common_prefix, row_draws
from .tree import CopyIndex, Tree
from .tree_step import tree_step

# features pending past which a cycle without a draft forward hands them to the drafter's context (the work the next
# draft would do), which bounds what waits; a pause lasts at most MAX_PAUSE cycles, so its features are read once
PENDING_ABSORB = MAX_PAUSE


def check_fits(prompt_ids: Sequence[int], max_context: int | None) -> None:
    """One line when a prompt leaves no room in the target's context for a new token."""
    if max_context and len(prompt_ids) >= max_context:
        raise DFlashError(f"prompt: {len(prompt_ids)} tokens do not fit the target's context "
                          f"(max_position_embeddings {max_context})")


class Engine:
    """Speaks the batch protocol dflash.core.loop drives (prefill / draft / verify / commit / retire) for one row or many,
    plus the single-sequence operations a chat needs (crop, reset, cached_tokens)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *, block_size: int = 1,
                 prefill_chunk: int = 2048, name: str = ""):
        self.target, self.drafter = target, drafter  # a backend's primitives (contract.py)
        self.name = name
        self.block_size = block_size if drafter is not None else 1
        self.prefill_chunk = prefill_chunk
        self.max_context = target.max_context
        self.info = target.info
        self.rows: list[list[int]] = []  # per row: ids whose K/V is in the target cache
        self.shared = False  # rows share the caches (a batch was admitted): no prefix reuse until reset
        self.queue = PendingFeatures()  # target features the drafter has not read yet (see `pending`)
        self.top_k = 0  # > 0: every draft also returns the per-position top-k (tree verification)
        self.sampling = SamplingParams()  # the settings of rows admitted without their own
        self.row_sampling: list[RowSampling] = []  # per row: its settings, acceptance rule and noise seed
        self.logprobs: int | None = None  # None: off; k >= 0: every sample also returns log-probs (top k)
        self.first_logprobs: tuple[list[float], list[list[tuple[int, float]]]] | None = None  # last prefill's
        self.prefix_cache: PrefixCache | None = None  # finished rows' caches, for later prompts (enable_prefix_cache)
        self.last_reused = 0  # prompt tokens the last prefill found in the caches
        self.verify_mode, self.verify_note = "chain", ""
        self.planner: TreePlanner | None = None  # tree / auto verification (dflash/core/budget.py)
        self.chain_budget: ChainBudget | None = None  # auto, for rows that verify by rejection
        self._copies: list[CopyIndex] = []  # per row: prompt lookup for the tree's copied branch
        self.last_trees: list[Tree] = []  # the last tree cycle's trees and accepted paths
        self.last_paths: list[list[int]] = []

    # ---- what the caches hold ------------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """Row 0's cached ids (the single-sequence view)."""
        return self.rows[0] if self.rows else []

    @property
    def cached_tokens(self) -> list[int]:
        return self.tokens

    @property
    def pending(self) -> Pending | None:
        """The target features the drafter has not read yet, as one Pending (joined now if cycles left parts)."""
        return self.queue.peek(self.target)

    @pending.setter
    def pending(self, pending: Pending | None) -> None:
        self.queue.set(pending)

    @property
    def capabilities(self) -> Capabilities:
        """What this engine's target can do (batches, trees), as its backend declares."""
        return self.target.capabilities

    def set_sampling(self, params: SamplingParams) -> None:
        """The sampling settings of the next lone row (and of rows admitted without their own)."""
        self.sampling = params
        self.target.set_sampling(params)

    @property
    def accept_rules(self) -> list[str]:
        """Each row's acceptance rule: greedy, match, rejection, argmax, sharpened, shaped or multi
        (dflash.core.sampling)."""
        return [r.rule for r in self.row_sampling]

    def set_verify(self, mode: str = "chain", budget: int | None = None, costs: Costs | None = None,
                   copy_branch: bool = True, itl_limit: float | None = ITL_LIMIT) -> None:
        """chain: verify the B-1 proposals. tree: a tree of `budget` nodes every cycle. auto: each cycle, the node
        count that maximises committed tokens per second under `costs` (chain when that is best), in cycles that
        take at most `itl_limit` plain steps per token any row expects (None: no limit)."""
        if mode not in VERIFY_MODES:
            raise SettingError("verify", f"got {mode!r}, expected one of {', '.join(VERIFY_MODES)}")
        if budget is not None and budget < 1:
            raise SettingError("tree_budget", f"got {budget}, expected >= 1 draft nodes")
        self.verify_mode, self.verify_note, self.planner, self.top_k = mode, "", None, 0
        self.chain_budget = None
        if mode == "chain" or self.drafter is None:
            self.verify_mode = "chain"
            return
        reason = self.target.capabilities.tree_refusal
        selector = mode == "auto" and not reason and self.drafter is not None and self.drafter.distribution
        if selector:
            # DFlash2: its selector walk picks each proposal given the previous one; trees would branch over the
            # raw top-k without it. auto still chooses how much of the chain to verify, or a plain step (a target
            # that refuses trees keeps its full chain: a static cache wants one verify shape)
            reason = "DFlash2's selector chooses the proposals"
            self.chain_budget = ChainBudget(self.block_size, costs) if costs else None
        if reason:
            if mode == "tree":
                raise DFlashError(f"--verify tree: {reason}; use --verify chain or auto")
            self.verify_mode, self.verify_note = "chain", f"auto verifies the chain: {reason}"
            return
        if mode == "auto" and costs is None:
            raise DFlashError("--verify auto: needs the device's measured costs (dflash.core.costs.measured_costs)")
        if budget is None:  # tree: the chain's verify tokens; auto: as many as the measured costs reach
            budget = self.block_size - 1 if mode == "tree" or costs is None else max(
                self.block_size - 1, min(256, costs.verify[-1][0] - 1))
        self.planner = TreePlanner(mode, self.block_size, budget, costs, copy_branch, itl_limit)
        self.top_k = self.planner.top_k
        self.chain_budget = ChainBudget(self.block_size, costs) if mode == "auto" and costs is not None else None

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

    def keep_prefix(self, i: int) -> None:
        """Row i's caches, copied out, go to the prefix cache (if one is on) for later prompts."""
        if self.prefix_cache is not None:
            row = Engine(self.target.extract(i), self.drafter.extract(i) if self.drafter else None,
                         block_size=self.block_size, prefill_chunk=self.prefill_chunk)
            row.rows = [list(self.rows[i])]
            keep_row(self.prefix_cache, row)

    def _adopt_prefix(self, prompt_ids: list[int]) -> None:
        """Before a lone prefill: take the kept prefix that beats the caches' own (keeping theirs if it is lost)."""
        if self.prefix_cache is None:
            return
        own = common_prefix(self.tokens, prompt_ids[:-1])
        if self.rows and len(self.tokens) - own >= self.prefix_cache.min_tokens:
            self.keep_prefix(0)
        row = self.prefix_cache.take(prompt_ids, at_least=own)
        if row is not None:
            self.target, self.drafter, self.rows, self.pending = row.target, row.drafter, row.rows, None
            self.target.set_sampling(self.sampling)

    # ---- prefill ---------------------------------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]],
                samplings: Sequence[SamplingParams | None] | None = None) -> list[int]:
        """Feed the prompts and return each row's first token. One prompt reuses the longest cached prefix (a chat's
        earlier turns); several start a fresh batch, one admitted row each. samplings: row i's own settings."""
        for p in prompts:
            check_fits(p, self.max_context)
        samplings = list(samplings) if samplings is not None else [None] * len(prompts)
        if len(prompts) == 1 and not self.shared:
            if samplings[0] is not None:
                self.set_sampling(samplings[0])
            self._adopt_prefix(list(prompts[0]))
            return [self._prefill_single(list(prompts[0]))]
        self.reset()
        return [self.admit(p, s) for p, s in zip(prompts, samplings)]

    def admit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, generated: int = 0) -> int:
        """A new row joins the running batch between cycles: its prompt is prefilled alone, then its caches are
        appended to the batch's. It samples with `sampling` (default: the engine's). `generated`: the last that many
        ids are the row's own output already (a row rebuilt from its committed tokens). Returns its first token."""
        prompt_ids = list(prompt_ids)
        check_fits(prompt_ids, self.max_context)
        if not self.rows:
            if sampling is not None:
                self.set_sampling(sampling)
            self._adopt_prefix(prompt_ids)
            return self._prefill_single(prompt_ids, generated)
        admission = self.begin_admit(prompt_ids, sampling, generated=generated)
        while not admission.advance():
            pass
        return self.end_admit(admission)

    def begin_admit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                    chunk: int | None = None, generated: int = 0) -> Admission:
        """admit() in steps, for a caller that interleaves a joining prompt with the batch's cycles: the prompt is
        prefilled `chunk` tokens per Admission.advance() into caches of its own (dflash/core/admission.py), then
        end_admit merges it."""
        prompt_ids = list(prompt_ids)
        check_fits(prompt_ids, self.max_context)
        return Admission(self, prompt_ids, sampling, chunk, generated)

    def end_admit(self, admission: Admission, alone: bool = False) -> int:
        """Merge a prefilled row into the batch, target and drafter caches together or neither; `alone`: the batch
        emptied meanwhile, so the row's caches become the engine's. Returns its first token."""
        return admission.join(alone)

    def _prefill_single(self, prompt_ids: list[int], generated: int = 0) -> int:
        for first in self.prefill_chunks(prompt_ids, generated):
            pass
        return first

    def prefill_chunks(self, prompt_ids: list[int], generated: int = 0):
        """Prefill chunk by chunk: yields None after every chunk but the last, then the first token. `generated`:
        the last that many ids are the row's own output (see admit)."""
        self._copies = []
        self.crop(common_prefix(self.tokens, prompt_ids[:-1]))  # keeps >= 1 token to compute the first one from
        if not self.rows:  # (a fresh engine, or the crop had to start over)
            self.rows = [[]]
        start, logits = len(self.tokens), None
        self.last_reused = start
        # a fresh noise seed per generation (unless the request has one): its draws are keyed by position
        self.row_sampling = [RowSampling.admit(self.sampling, self.drafter is not None and self.drafter.distribution,
                                               trees=self.verify_mode == "tree",
                                               prompt_tokens=len(prompt_ids) - generated)]
        for at in range(start, len(prompt_ids), self.prefill_chunk):
            chunk = prompt_ids[at:at + self.prefill_chunk]
            logits, features = self.target.forward(self.target.ids([chunk]), last_only=True)
            self.tokens.extend(chunk)
            if self.drafter is not None:
                self._add_pending(features, len(chunk))
                self.drafter.extend(self._take_pending())
            if at + self.prefill_chunk < len(prompt_ids):
                self.target.settle(self.drafter)  # bound the lazy graph (and its memory) chunk by chunk
                yield None
        assert logits is not None  # (prefill runs at least the prompt's last token)
        first, logprobs = self._sample(logits[:, -1:], [self.tokens], None, draws=self._row_draws(1, offset=0))
        self.target.settle(self.drafter, first)
        if logprobs is not None:
            self.first_logprobs = (logprobs[0][0][0], logprobs[1][0][0])
        yield self.target.to_host(first)[0][0]

    # ---- the cycle -------------------------------------------------------------------------------------------------
    def step(self, anchors: Sequence[int]) -> list[Step]:
        """One speculative cycle for every row (draft -> verify -> accept -> commit); row i's anchor is its last
        committed token."""
        context = max(map(len, self.rows), default=0)  # what every verify token attends to (rows pad to the longest)
        for budget in (self.planner, self.chain_budget):
            if budget is not None:
                budget.context = context
        if self.chain_budget is not None and (self.planner is None or any(not r.greedy for r in self.row_sampling)):
            # chains only (sampled rows, a DFlash2 drafter, a target without trees): auto chooses their length, or a
            # plain step
            start = time.perf_counter()
            length = self.chain_budget.length(rows=len(self.rows))
            steps = self._chain_step(anchors, top_k=0, length=length)
            self.chain_budget.observe(length, [s.accepted for s in steps], time.perf_counter() - start)
            return steps
        if self.planner is not None:
            start = time.perf_counter()
            path = self.planner.path() if not any(r.chains_only for r in self.row_sampling) else "chain"
            steps = tree_step(self, list(anchors)) if path == "tree" else self._chain_step(anchors, top_k=0)
            self.planner.observe_speed(path, [s.accepted for s in steps], time.perf_counter() - start)
            return steps
        return self._chain_step(anchors, self.top_k)

    def _chain_step(self, anchors: Sequence[int], top_k: int, length: int | None = None) -> list[Step]:
        """Draft, verify the first `length` proposals (default: all B-1; 0: no draft forward), commit."""
        verified = self.block_size if length is None else length + 1
        # a matched row's draft reads the noise of every block position; otherwise only the verified ones are drawn,
        # and a cycle without a draft forward draws what a plain step does: its one token's
        drafts_read_noise = length != 0 and "match" in self.accept_rules
        draws = self._row_draws(self.block_size if length != 0 else 1,
                                noise=self.block_size if drafts_read_noise else verified)
        if length == 0:  # (the pending features wait for the next draft forward: see commit)
            draft = Draft(self.target.ids([[a] for a in anchors]))
        else:  # (a draft of `length` proposals fills just those positions: the drafter's work grows with them)
            draft = self.draft(anchors, top_k, draws, block=verified)
        result = self.verify(draft, draws)
        drafted = length != 0 and self.drafter is not None
        steps = [Step(t[: accepted_length(d, t) + 1], d, len(d), drafted)
                 for d, t in zip(result.proposals, result.tokens)]
        if draws is not None and length != 0:  # what each row's proposal shape accepted (dflash.core.shapes)
            for draw, step in zip(draws, steps):
                draw.sampling.shapes.observe(draw.draft_temperature, step.accepted, step.verified)
        if result.logprobs is not None and result.top_logprobs is not None:
            for step, chosen, top in zip(steps, result.logprobs, result.top_logprobs):
                step.logprobs, step.top_logprobs = chosen[:len(step.tokens)], top[:len(step.tokens)]
        self.commit(result, [len(s.tokens) for s in steps])
        return steps

    def draft(self, anchors: Sequence[int], top_k: int | None = None,
              draws: list[RowDraw] | None = None, block: int | None = None) -> Draft:
        """Each row's block [anchor, proposals] of `block` positions (default: the block size; the anchor alone
        without a drafter), from the features pending."""
        anchor_ids = self.target.ids([[a] for a in anchors])
        if self.drafter is None:
            return Draft(anchor_ids)
        return self.drafter.propose(anchor_ids, self._take_pending(), block or self.block_size,
                                    self.top_k if top_k is None else top_k, draws)

    def verify(self, draft: Draft, draws: list[RowDraw] | None = None) -> Verified:
        """The target's token at every position of each row's block, in one forward, under the row's rule: its own
        draw (greedy, match), or, for a row verifying by rejection (any proposal shape), the draft token where
        rejection sampling accepts it and the residual's draw where it does not (so the longest agreeing prefix is
        the accepted one either way)."""
        logits, features = self.target.forward(draft.ids, last_only=False)
        tokens, logprobs = self._sample(logits, self.rows, draft.ids, draws=draws, draft=draft)
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

    def _queue_pending(self, new: Pending) -> None:
        """A cycle's committed features wait for the drafter. After a cycle without a draft forward (a plain step, or
        copied nodes alone) they wait behind the earlier pending ones, unjoined: the next draft takes them all in one
        forward, so such a cycle costs no drafter forward of its own (PENDING_ABSORB of them go to the drafter's
        context at once)."""
        self.queue.add(new)
        if max(self.queue.counts) >= PENDING_ABSORB:
            assert self.drafter is not None  # (features pend for a drafter only)
            self.drafter.extend(self._take_pending())

    def retire(self, rows: Sequence[int]) -> None:
        """Drop finished rows (indices into the current rows) from every cache."""
        gone = set(rows)
        keep = [i for i in range(len(self.rows)) if i not in gone]
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
            if self.pending is not None:
                self.pending = Pending(self.target.take_rows(self.pending.features, keep),
                                       [self.pending.counts[i] for i in keep])
        self.rows = [self.rows[i] for i in keep]
        self.row_sampling = [self.row_sampling[i] for i in keep]
        self._copies = [self._copies[i] for i in keep] if len(self._copies) == len(keep) + len(gone) else []

    # ---- single sequence: rewind and reset ---------------------------------------------------------------------------
    def crop(self, length: int) -> None:
        """Forget every cached position from `length` on (target and drafter)."""
        if len(self.rows) > 1:
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
        if length < position:
            self.pending = None
            if not self.drafter.crop(length):
                self.reset()  # the window dropped what we need: rebuild the whole context from scratch
        elif self.pending is not None and length < position + self.pending.counts[0]:
            n = length - position
            self.pending = Pending(self.target.head(self.pending.features, n), [n])

    def reset(self) -> None:
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.rows, self.pending, self.shared, self._copies = [], None, False, []
        self.row_sampling = []

    def close(self) -> None:
        self.target.close()

    # ---- internals -----------------------------------------------------------------------------------------------
    def _row_draws(self, width: int, offset: int = 1, noise: int | None = None) -> list[RowDraw] | None:
        return row_draws(self.rows, self.row_sampling, lambda keys: self.target.gumbel(keys), width, offset, noise)

    def _add_pending(self, features, n: int) -> None:
        self.queue.add(Pending(features, [n]))

    def _sample(self, logits, histories, block, paths=None, draws=None, draft=None):
        """(the target's tokens, None); with self.logprobs set, (tokens, (chosen, tops)): per row and position the
        chosen token's log-probability and its top (id, log-probability) pairs, on the host."""
        starts = [r.prompt_tokens for r in self.row_sampling]
        if self.logprobs is None:
            return self.target.sample(logits, histories, block, paths, draws=draws, draft=draft,
                                      starts=starts), None
        tokens, (chosen, top_ids, top_lps) = self.target.sample(logits, histories, block, paths,
                                                                logprobs=self.logprobs, draws=draws, draft=draft,
                                                                starts=starts)
        chosen, top_ids, top_lps = (self.target.to_host(x) for x in (chosen, top_ids, top_lps))
        tops = [[list(zip(i, v)) for i, v in zip(ri, rv)] for ri, rv in zip(top_ids, top_lps)]
        return tokens, (chosen, tops)

    def _take_pending(self) -> Pending | None:
        return self.queue.take(self.target)
