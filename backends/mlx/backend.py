"""MLX backend: an mlx-lm target + a DFlash drafter as primitives of the one engine (dflash/core/engine.py).

Everything stays lazy inside a cycle: the draft's proposals feed the verify forward as an array, and the only
device -> host read is the `tolist()` of the B drafted + B target ids at the end of verify(). One row at a time:
mlx-lm's KV caches keep one offset for the whole batch, so rows advancing at different rates would need a masked
cache of our own under every mlx-lm model file.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from dflash.core.blas import openblas_preloaded
from dflash.core.contract import Capabilities
from dflash.core.engine import Engine
from dflash.core.errors import DFlashError
from dflash.core.rules import SLIDING_TREE_REFUSAL
from dflash.core.sampling import SamplingParams
from dflash.core.spec import drafter_block_size
from dflash.core.tree import TreeInputs

from .draft_runner import MLXDraft
from .drafter import DFlashDrafter
from .rewind import MLXRewind, needs_rewind
from .sampling import MLXSampler, gumbel, rejection_tokens
from .target import TargetRunner, embedding, lm_head, target_info
from .tree import keep_path, tree_positions, tree_refusal

_ONE_ROW = "--batch-size: batched decoding runs on the torch backend; use --backend torch or --batch-size 1"


class MLXTarget:
    def __init__(self, model, config: dict, layer_ids: list[int] | None = None):
        self.model, self.config = model, config
        self.info = target_info(model, config)
        self.max_context = config.get("text_config", config).get("max_position_embeddings")
        self.runner = TargetRunner(model, config, layer_ids)
        self.rewind: MLXRewind | None = None  # sliding-window / linear-attention targets (gpt-oss, Qwen3.5)
        self.cache = self._new_cache()
        self.sampler = MLXSampler(SamplingParams())

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
        return x.tolist()

    def settle(self, drafter=None, *arrays) -> None:
        """Evaluate the lazy graph: the caches (and the given arrays) become concrete, which bounds its memory."""
        state = [c.state for c in self.cache] + (drafter.state() if drafter is not None else [])
        mx.eval(*arrays, state)

    def take_rows(self, features, rows):
        raise DFlashError(_ONE_ROW)

    pad_rows = take_rows

    # ---- sampling --------------------------------------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        self.sampler = MLXSampler(params)

    def sample(self, logits: mx.array, histories: list[list[int]], block: mx.array | None, paths=None,
               logprobs: int | None = None, draws=None, draft=None):
        """One row: see dflash/core/contract.py."""
        scores = self.sampler.processed(logits[0], histories[0], None if block is None else block[0],
                                        None if paths is None else paths[0])
        draw = draws[0] if draws is not None else None
        n = scores.shape[0] - 1  # (a chain may verify fewer positions than its draws cover)
        tokens = self.sampler.draw(scores, None if draw is None or draw.gumbel is None else draw.gumbel[: n + 1])
        if draw is not None and draw.rule == "rejection" and draft is not None and draft.q_probs is not None:
            tokens = rejection_tokens(self.sampler.probabilities(scores), block[0, 1:], draft.q_ids[0, :n],
                                      draft.q_probs[0, :n], mx.array(draw.accept_u[:n]), mx.array(draw.residual_u[:n]),
                                      tokens[-1])
        tokens = tokens[None].astype(mx.int32)
        if logprobs is None:
            return tokens
        return tokens, tuple(x[None] for x in self.sampler.log_probs(scores, tokens[0], logprobs))

    def gumbel(self, keys: list[int]) -> mx.array:
        return gumbel(keys, self.info.vocab_size)

    # ---- forward, keep, trim -----------------------------------------------------------------------------------------
    def forward(self, ids: mx.array, last_only: bool, tree: TreeInputs | None = None):
        if tree is not None:
            with tree_positions(self.runner.layers, self.cache, tree):
                return self.runner(ids, self.cache, last_only=False)
        if self.rewind is None:
            return self.runner(ids, self.cache, last_only)
        self.rewind.before_forward()
        with self.rewind.recording():
            out = self.runner(ids, self.cache, last_only)
        self.rewind.after_forward(ids.shape[1])
        return out

    def keep(self, keeps: list[int], width: int) -> bool:
        return keeps[0] == width or self.trim(width - keeps[0])

    def trim(self, n: int) -> bool:
        """Forget the last n target positions; False if the cache cannot go back that far (see rewind.py)."""
        if self.rewind is not None:
            return self.rewind.rewind(n)
        # a rotating cache stops being trimmable once it wraps; rewinding it silently would corrupt the output
        if trim_prompt_cache(self.cache, n) != n:
            raise DFlashError(f"{self.info.model_type}: the target's mlx-lm cache could not be rewound by {n} "
                              "positions (a rotating/sliding cache that already wrapped)")
        return True

    def reset(self) -> None:
        self.cache = self._new_cache()

    # ---- trees -------------------------------------------------------------------------------------------------------
    def device_key(self) -> str:
        """What the costs of a forward depend on besides shapes (dflash/core/costs.py)."""
        dtype = embedding(self.model).weight.dtype
        blas = "openblas" if openblas_preloaded() else "own blas"  # 20-30x apart on a Linux CPU (dflash/core/blas.py)
        blas += f" {os.environ.get('OPENBLAS_NUM_THREADS') or os.environ.get('OMP_NUM_THREADS') or 'all'} threads"
        return f"mlx {mx.__version__} {mx.default_device()} {dtype} {blas}"

    @property
    def capabilities(self) -> Capabilities:
        if self.rewind is not None:
            trees = SLIDING_TREE_REFUSAL.format(model_type=self.info.model_type)
        else:
            trees = tree_refusal(self.runner, self.cache)
        return Capabilities(batch_refusal=_ONE_ROW, tree_refusal=trees)

    def keep_slots(self, slots: list[list[int]], width: int) -> None:
        (row,) = slots
        if row == list(range(len(row))):
            self.keep([len(row)], width)
        else:
            keep_path(self.cache, row, width)

    @staticmethod
    def gather(features: mx.array, slots: list[list[int]]) -> mx.array:
        return mx.take(features, mx.array(slots[0], dtype=mx.int32), axis=1)

    def close(self) -> None:
        pass

    # ---- rows: one ---------------------------------------------------------------------------------------------------
    def spawn(self):
        raise DFlashError(_ONE_ROW)

    merge = select = extract = spawn

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


def mlx_engine(model, config: dict, drafter: DFlashDrafter | None = None, block_size: int | None = None,
               draft_window: int | None = None, prefill_chunk: int = 2048, validated: bool = False) -> Engine:
    """The engine over an mlx-lm target (+ a drafter), one row."""
    target = MLXTarget(model, config, drafter.spec.target_layer_ids if drafter is not None else None)
    draft = None
    if drafter is not None:
        block_size = drafter_block_size(drafter, target.info, block_size, validated)
        embed = embedding(model)
        dtype = embed(mx.array([[0]])).dtype  # the drafter computes in the dtype the embeddings come out in
        draft = MLXDraft(drafter, embed, lm_head(model), dtype, window=draft_window,
                         logit_scaling=drafter.spec.logit_scaling(target.info))
    return Engine(target, draft, block_size=block_size or 1, prefill_chunk=prefill_chunk, name="mlx")
