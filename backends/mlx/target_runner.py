"""The target's primitives for dflash.core.engine on MLX: an mlx-lm model, its cache, rows, sampling.

Everything stays lazy inside a cycle: the draft's proposals feed the verify forward as an array, and the only
device -> host read is the `tolist()` of the B drafted + B target ids at the end of verify(). The cache's rows (mlx-lm's
KVCache, one offset for the batch) are a dflash.core.rows.SharedRows (row_slots.RowSlots moves the entries): a lone
row without holes runs mlx-lm's own forward, rows of a batch give every row's tokens their own positions and a mask
over the row's valid slots (backends/mlx/tree.py), as the torch backend does.
"""

from __future__ import annotations

from typing import Sequence, cast

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from dflash.core.contract import Capabilities
from dflash.core.errors import DFlashError
from dflash.core.rows import SharedRows
from dflash.core.rules import SLIDING_BATCH_REFUSAL, SLIDING_TREE_REFUSAL
from dflash.core.sampling import RowSampling
from dflash.core.tree import TreeInputs

from .rewind import MLXRewind, needs_rewind
from .row_slots import RowSlots
from .sampling import gumbel, multi_candidate_tokens, rejection_tokens, sampler
from .target import TappedForward, target_info
from .tree import explicit_positions, positions_refusal


class MLXTarget:
    def __init__(self, model, config: dict, layer_ids: list[int] | None = None, *,
                 runner: TappedForward | None = None):
        self.model, self.config = model, config
        self.info = target_info(model, config)
        self.max_context = config.get("text_config", config).get("max_position_embeddings")
        self.runner = runner or TappedForward(model, config, layer_ids)  # (a spawned row's: its batch's)
        self.rewind: MLXRewind | None = None  # sliding-window / linear-attention targets (gpt-oss, Qwen3.5)
        self.cache = self._new_cache()
        self.slots: SharedRows[RowSlots] = SharedRows(RowSlots(self.cache, self.rewind))  # the cache's rows

    # ---- arrays ----------------------------------------------------------------------------------------------------
    @staticmethod
    def ids(rows: list[list[int]]) -> mx.array:
        return mx.array(rows, dtype=mx.int32)

    @staticmethod
    def cat(parts: list[mx.array]) -> mx.array:
        return mx.concatenate(parts, axis=1)

    @staticmethod
    def head(features: mx.array, n: int) -> mx.array:
        return features[:, :n]

    @staticmethod
    def to_host(x: mx.array) -> list[list[int]]:
        return cast("list[list[int]]", x.tolist())  # (a 2-D integer array)

    @staticmethod
    def start(*arrays: mx.array) -> None:
        """Compute them in the background (a plain step's next forward, while the host reads this one's tokens)."""
        mx.async_eval(*arrays)

    def settle(self, drafter=None, *arrays) -> None:
        """Evaluate the lazy graph: the caches (and the given arrays) become concrete, which bounds its memory. The
        prefill's transient buffers then go back to the system, not to MLX's pool, as mlx-lm does after each
        prefill chunk: a server's joins and leaves change every buffer's shape, so the pool would keep growing."""
        state = [c.state for c in self.cache] + (drafter.state() if drafter is not None else [])
        mx.eval(*arrays, state)
        mx.clear_cache()

    @staticmethod
    def take_rows(features: mx.array, rows: list[int]) -> mx.array:
        return features[mx.array(rows, dtype=mx.int32)]

    @staticmethod
    def pad_rows(features: mx.array, n: int) -> mx.array:
        return mx.concatenate([features, mx.zeros((n, *features.shape[1:]), dtype=features.dtype)])

    # ---- sampling --------------------------------------------------------------------------------------------------
    def sample(self, logits: mx.array, histories: list[list[int]], block: mx.array | None,
               rows: Sequence[RowSampling], paths=None, logprobs: int | None = None, draws=None, draft=None):
        """Every row with its own history, settings and draws: see dflash/core/contract.py."""
        if draws is None and logprobs is None and not any(r.params.processors for r in rows):
            return mx.argmax(logits, axis=-1).astype(mx.int32)  # all greedy: one argmax for the batch
        drawn, stats = [], []
        for i, r in enumerate(rows):
            row_sampler = sampler(r.params)
            scores = row_sampler.processed(logits[i], histories[i], None if block is None else block[i],
                                           None if paths is None else paths[i], r.prompt_tokens)
            draw = draws[i] if draws is not None else None
            n = scores.shape[0] - 1  # (a chain may verify fewer positions than its draws cover)
            row = row_sampler.draw(scores, None if draw is None or draw.gumbel is None else draw.gumbel[: n + 1])
            if draw is not None and draw.children is not None:  # a multi row's tree: rejection at every node
                row = multi_candidate_tokens(row_sampler.probabilities(scores), draw)
            elif draw is not None and draw.rejects and draft is not None and draft.q_probs is not None \
                    and block is not None:
                row = rejection_tokens(row_sampler.probabilities(scores), block[i, 1:], draft.q_ids[i, :n],
                                       draft.q_probs[i, :n], mx.array(draw.accept_u[:n]),
                                       mx.array(draw.residual_u[:n]), row[-1])
            drawn.append(row.astype(mx.int32))
            if logprobs is not None:
                stats.append(row_sampler.log_probs(scores, drawn[-1], logprobs))
        tokens = mx.stack(drawn)
        if logprobs is None:
            return tokens
        return tokens, tuple(mx.stack(list(parts)) for parts in zip(*stats))

    def gumbel(self, keys: list[int]) -> mx.array:
        return gumbel(keys, self.info.vocab_size)

    # ---- forward, keep, trim -----------------------------------------------------------------------------------------
    def forward(self, ids: mx.array, last_only: bool, tree: TreeInputs | None = None):
        if tree is not None:
            with explicit_positions(self.runner.layers, self.cache, *self.slots.append_tree(tree)):
                return self.runner(ids, self.cache, last_only=False)
        if not self.slots.lone:
            with explicit_positions(self.runner.layers, self.cache, *self.slots.append(ids.shape[1])):
                return self.runner(ids, self.cache, last_only)
        self.slots.grow(ids.shape[1])
        if self.rewind is None:
            return self.runner(ids, self.cache, last_only)
        self.rewind.before_forward()
        with self.rewind.recording():
            out = self.runner(ids, self.cache, last_only)
        self.rewind.after_forward(ids.shape[1])
        return out

    def keep(self, keeps: list[int], width: int) -> bool:
        return self.slots.keep(keeps, width)

    def trim(self, n: int) -> bool:
        """Forget the last n target positions; False if the cache cannot go back that far (see rewind.py)."""
        return self.slots.trim(n)

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.slots = SharedRows(RowSlots(self.cache, self.rewind))

    # ---- trees -------------------------------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(batch_refusal=self._batch_refusal(), tree_refusal=self._tree_refusal())

    def _tree_refusal(self) -> str | None:
        if self.rewind is not None:
            return SLIDING_TREE_REFUSAL.format(model_type=self.info.model_type)
        return positions_refusal(self.runner, self.cache)

    def _batch_refusal(self) -> str | None:
        if self.rewind is not None:
            return SLIDING_BATCH_REFUSAL
        reason = positions_refusal(self.runner, self.cache)
        return None if reason is None else f"--batch-size: rows sharing a cache need explicit positions: {reason}"

    def _check_batchable(self) -> None:
        refusal = self._batch_refusal()
        if refusal:
            raise DFlashError(refusal)

    def keep_slots(self, slots: list[list[int]], width: int) -> None:
        if all(s == list(range(len(s))) for s in slots):
            self.keep([len(s) for s in slots], width)
        else:
            self.slots.keep_slots(slots, width)

    @staticmethod
    def gather(features: mx.array, slots: list[list[int]]) -> mx.array:
        """Row i's features at slots[i] of the last forward, packed to the left (padded with its last)."""
        width = max(len(s) for s in slots)
        idx = mx.array([s + [s[-1]] * (width - len(s)) for s in slots], dtype=mx.int32)
        return mx.take_along_axis(features, idx[:, :, None], axis=1)

    def close(self) -> None:
        pass

    # ---- rows --------------------------------------------------------------------------------------------------------
    def spawn(self) -> "MLXTarget":
        """The same model with an empty cache (a row prefilled alone, then merged)."""
        self._check_batchable()
        return MLXTarget(self.model, self.config, runner=self.runner)

    def merge(self, other: "MLXTarget") -> None:
        """Append other's row to this batch (SharedRows.join: the shorter side left-padded with masked slots)."""
        self._check_batchable()
        self.slots.join(other.slots.buffers, other.slots.width)

    def select(self, rows: list[int]) -> None:
        self.slots.select(rows)

    def extract(self, i: int) -> "MLXTarget":
        """Row i alone on a cache of its own (its valid slots, in order): a prefix kept after it leaves the batch."""
        row = self.spawn()
        self.slots.extract(i, row.slots)
        return row

    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.cache)

    def _new_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        if needs_rewind(cache):
            if self.rewind is None:
                self.rewind = MLXRewind(self.runner.layers, cache)
            self.rewind.attach(cache)
            return cache
        if not can_trim_prompt_cache(cache):
            raise DFlashError(f"{self.info.model_type}: this target's mlx-lm cache cannot be rewound (recurrent or "
                              "rotating layers), which speculative decoding needs")
        return cache
