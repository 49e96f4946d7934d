"""The target's primitives for dflash.core.engine on torch: forward with feature capture, keep / trim, rows, sampling.

The cache's rows are a dflash.core.rows.SharedRows (valid slots, holes, positions, rewinds, compaction, joins and
leaves), which moves their K/V through kv_cache.RowSlots. A lone row without holes runs on the transformers cache as
it is (DynamicCache, or a preallocated StaticCache for compiled decoding; sliding-window and linear-attention layers
rewind through CacheRewind), with positions implied by the cache length; rows of a batch advance at different
rates, their tokens at explicit position_ids under a 4D mask.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, StaticCache

from dflash.core.contract import Capabilities, Drafter
from dflash.core.errors import DFlashError
from dflash.core.rows import SharedRows
from dflash.core.rules import SLIDING_BATCH_REFUSAL, SLIDING_TREE_REFUSAL
from dflash.core.sampling import RowSampling
from dflash.core.tree import TreeInputs

from .kv_cache import RowSlots, attention_window, growing, set_window, window_of, windowed
from .rewind import CacheRewind, bounded_layers
from .sampling import gumbel, log_probs, multi_candidate_tokens, rejection_tokens, sampler
from .target import GROUPED_SDPA, LayerCapture, target_info


class TorchTarget:
    def __init__(self, model, layer_ids: list[int] | None = None, *, cache_len: int | None = None,
                 compile: bool = False, capture: LayerCapture | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.info = target_info(model)
        self.max_context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.additive_mask = model.config._attn_implementation == "eager"
        self.capture = capture if capture is not None or layer_ids is None else LayerCapture(model, layer_ids)
        # cache_len: a preallocated StaticCache (fixed addresses, what torch.compile / CUDA graphs want); its crop
        # only moves the write position, and stale entries past it are masked by causality until overwritten. A
        # forward attends over a window of it only (kv_cache.WindowedStaticLayer)
        self.cache_len = cache_len
        self.rewind: CacheRewind | None = None  # sliding-window / linear-attention targets (gpt-oss, Qwen3.5)
        self.cache = self._new_cache()
        self.slots: SharedRows[RowSlots] = SharedRows(RowSlots(self.cache, self.rewind))  # the cache's rows
        # compile: the decode forwards (a plain step, a verify) go through torch.compile, prefill stays eager. The
        # cache's attention window (kv_cache.attention_window) and the token count are specialised on their first
        # value and compiled as symbols on their second (dynamic=None), so a run compiles a few graphs, not one a shape
        self._decode_model = model
        if compile and cache_len is None:
            raise DFlashError("compile: the compiled forwards run on a static cache; give cache_len")
        if compile:
            # dynamo skips guards on module hooks by default: a graph compiled for an engine without feature capture
            # would then run for one with it (the same model) and capture nothing
            torch._dynamo.config.skip_nnmodule_hook_guards = False
            # up to four graphs per engine (two token counts x two windows), engines on one model share the cache
            # of its forward, and with fullgraph=True going past the limit fails the forward
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._decode_model = torch.compile(model, dynamic=None, fullgraph=True,
                                               mode="reduce-overhead" if self.device.type == "cuda" else None)

    @property
    def length(self) -> int:
        """Slots per row of the cache (a lone row: its positions)."""
        return self.slots.width

    # ---- arrays ----------------------------------------------------------------------------------------------------
    def ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @staticmethod
    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=1)

    @staticmethod
    def head(features: torch.Tensor, n: int) -> torch.Tensor:
        return features[:, :n]

    @staticmethod
    def take_rows(features: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return features[torch.tensor(rows, device=features.device)]

    @staticmethod
    def pad_rows(features: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([features, features.new_zeros(n, *features.shape[1:])])

    @staticmethod
    def to_host(x: torch.Tensor) -> list[list[int]]:
        return x.tolist()

    def settle(self, drafter: Drafter | None = None, *arrays) -> None:
        """Nothing to do: torch runs eagerly (MLX evaluates its lazy graph here)."""

    # ---- sampling --------------------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, histories: list[list[int]], block: torch.Tensor | None,
               rows: Sequence[RowSampling], paths: list[list[list[int]]] | None = None, logprobs: int | None = None,
               draws=None, draft=None):
        """The target's token at every position of every row (rows, T), each row with its own history, settings
        (rows[i]) and draws (dflash.core.sampling.RowDraw; None: all greedy); rejection rows verify `draft`'s sampled
        proposals. For a tree, position j follows history + paths[row][j]; row i's output starts at
        histories[i][rows[i].prompt_tokens]. With logprobs=k also (chosen, top-k ids, top-k log-probs) of the
        distributions the tokens were drawn from."""
        if draws is None and not any(r.params.processors for r in rows):
            scores = logits  # the common case: one argmax for the whole batch
            tokens = logits.argmax(dim=-1)
        else:
            samplers = [sampler(r.params) for r in rows]
            per_row = [s.scores(logits[i], histories[i], None if block is None else block[i],
                                None if paths is None else paths[i], r.prompt_tokens)
                       for i, (s, r) in enumerate(zip(samplers, rows))]
            drawn = []
            for i, (row_sampler, scores) in enumerate(zip(samplers, per_row)):
                draw = draws[i] if draws is not None else None
                t = scores.shape[0]  # (a chain may verify fewer positions than its draws cover)
                row = row_sampler.draw(scores, None if draw is None or draw.gumbel is None else draw.gumbel[:t])
                if draw is not None and draw.children is not None:  # a multi row's tree: rejection at every node
                    row = multi_candidate_tokens(torch.softmax(scores.float(), dim=-1), draw)
                elif draw is not None and draw.rejects and draft is not None and draft.q_probs is not None \
                        and block is not None:
                    as_tensor = lambda u: torch.tensor(u[:t - 1], device=self.device)  # noqa: E731
                    row = rejection_tokens(torch.softmax(scores.float(), dim=-1), block[i, 1:], draft.q_ids[i, :t - 1],
                                           draft.q_probs[i, :t - 1].float(), as_tensor(draw.accept_u),
                                           as_tensor(draw.residual_u), row[-1])
                drawn.append(row)
            tokens = torch.stack(drawn)
            if logprobs is not None:
                scores = torch.stack(per_row)
        if logprobs is None:
            return tokens
        return tokens, log_probs(scores, tokens, logprobs)

    def gumbel(self, keys: list[int]) -> torch.Tensor:
        """Gumbel noise (len(keys), V) over the LM head's vocabulary, one row per key."""
        return gumbel(keys, self.model.get_output_embeddings().weight.shape[0], self.device)

    # ---- forward ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last_only: bool, tree: TreeInputs | None = None):
        """Append `ids` (rows, T) after every row's cached positions; logits and the captured features. With
        `tree`, slot j of row i sits at the row's next position + depth and sees the context and its ancestors."""
        t = ids.shape[1]
        if tree is not None:
            return self._forward_tree(ids, tree)
        if not self.slots.lone:
            return self._forward_rows(ids, last_only)
        if self.cache_len is not None:
            self._fit_static(t)
        if self.cache_len is not None and not last_only:  # a plain step or a chain, in the trees' compiled graphs
            positions = self.length + torch.arange(t, device=self.device)
            causal = torch.arange(self.length + t, device=self.device)[None] <= positions[:, None]
            self.slots.grow(t)
            return self._forward_static(ids, positions[None], causal[None])
        if self.rewind is not None:
            self.rewind.before_forward()
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.rewind is not None:
            self.rewind.after_forward(t)
        self.slots.grow(t)
        return out.logits, self.capture.pop() if self.capture is not None else None

    def warm_up(self) -> None:
        """Compile now what decoding would compile in the middle of a request: the compiled forwards are specialised
        on their first token count and window and become symbolic in each at its second value, so one and two tokens
        at two windows leave graphs that fit every later forward (in a process whose torch compile cache is warm,
        seconds; cold, a minute or two on a CPU)."""
        if self._decode_model is self.model or self.cache_len is None:
            return
        # (ids made outside inference mode, as Target.ids makes them: an inference tensor fails the graphs' guards)
        zeros = lambda n: torch.zeros(1, n, dtype=torch.long, device=self.device)  # noqa: E731
        size = self.cache_len
        for context in sorted({1, max(1, min(attention_window(1, size) + 1, size - 3))}):
            self.forward(zeros(context), last_only=True)
            for t in (1, 2):
                self.forward(zeros(t), last_only=False)
            self.reset()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(batch_refusal=self._batch_refusal(), tree_refusal=self._tree_refusal(),
                            compiles=self._decode_model is not self.model)

    def _tree_refusal(self) -> str | None:
        if self.rewind is not None:
            return SLIDING_TREE_REFUSAL.format(model_type=self.info.model_type)
        if self.model.config._attn_implementation not in ("sdpa", GROUPED_SDPA, "eager"):
            return (f"attention {self.model.config._attn_implementation!r} takes no 4D ancestor mask; "
                    "load the target with sdpa or eager attention")
        return None

    def _forward_tree(self, ids, tree: TreeInputs):
        if self.cache_len is not None:
            self._fit_static(ids.shape[1])
        positions, mask = (torch.from_numpy(a).to(self.device) for a in self.slots.append_tree(tree))
        if self.cache_len is not None:
            return self._forward_static(ids, positions, mask)
        out = self.model(input_ids=ids, attention_mask=self._attention_mask(mask), position_ids=positions,
                         cache=self.cache, use_cache=True, logits_to_keep=0)
        return out.logits, self.capture.pop() if self.capture is not None else None

    def _forward_static(self, ids, positions, mask):
        """A forward on the static cache (fitted: _fit_static) through the compiled model, at `positions` (1, T)
        under `mask` (1, T, length), which is padded to the cache's window: plain steps, chains and trees call it
        with the same arguments, so they share their compiled graphs (the token count and the window become symbols
        at their second value)."""
        mask = self._attention_mask(F.pad(mask, (0, window_of(self.cache) - mask.shape[-1])))
        out = self._decode_model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                                 use_cache=True, logits_to_keep=0)
        return out.logits, self.capture.pop() if self.capture is not None else None

    def _fit_static(self, t: int) -> None:
        """A forward of t tokens fits the static cache; its layers attend over the window that covers them."""
        assert self.cache_len is not None  # (static cache)
        if self.length + t > self.cache_len:
            raise DFlashError(f"context: {self.length + t} tokens exceed the static cache ({self.cache_len}); "
                              "raise cache_len")
        set_window(self.cache, self.length + t)

    def _attention_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """A (rows, T, keys) visibility mask as the attention takes it: (rows, 1, T, keys), boolean for SDPA,
        additive for eager attention."""
        mask = visible[:, None]
        if not self.additive_mask:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask,
                                                                                         torch.finfo(self.dtype).min)

    @staticmethod
    def gather(features: torch.Tensor, slots: list[list[int]]) -> torch.Tensor:
        """Row i's features at slots[i] of the last forward, packed to the left (zero-padded)."""
        width = max(len(s) for s in slots)
        idx = torch.tensor([s + [s[-1]] * (width - len(s)) for s in slots], device=features.device)
        return features.gather(1, idx[:, :, None].expand(-1, -1, features.shape[2]))

    @torch.inference_mode()
    def keep_slots(self, slots: list[list[int]], width: int) -> None:
        """After a tree forward of `width` slots, row i keeps slots[i] (the root and its accepted path, in order)."""
        if all(s == list(range(len(s))) for s in slots):
            self.keep([len(s) for s in slots], width)
        else:
            self.slots.keep_slots(slots, width)

    def _forward_rows(self, ids, last_only: bool):
        positions, visible = (torch.from_numpy(a).to(self.device) for a in self.slots.append(ids.shape[1]))
        mask = self._attention_mask(visible)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1 if last_only else 0)
        return out.logits, self.capture.pop() if self.capture is not None else None

    # ---- keep, trim, reset -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, keeps: list[int], width: int) -> bool:
        """After a forward of `width` positions, row i keeps its first keeps[i]; False if the cache cannot."""
        return self.slots.keep(keeps, width)

    @torch.inference_mode()
    def trim(self, n: int) -> bool:
        """Forget the last n positions of one row; False if its layers cannot go back that far."""
        return self.slots.trim(n)

    @torch.inference_mode()
    def reset(self) -> None:
        if self.cache_len is not None and self.length:
            self.cache.crop(-self.length)  # keep the static buffers (and any captured graphs) alive
        else:
            self.cache = self._new_cache()
        self.slots = SharedRows(RowSlots(self.cache, self.rewind))

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()
        if self.rewind is not None:
            self.rewind.remove()

    # ---- rows --------------------------------------------------------------------------------------------------------
    def spawn(self) -> "TorchTarget":
        """The same model and feature hooks with an empty dynamic cache (a row prefilled alone, then merged)."""
        self.check_batchable()
        return TorchTarget(self.model, capture=self.capture)

    @torch.inference_mode()
    def merge(self, other: "TorchTarget") -> None:
        """Append other's row to this batch (SharedRows.join: the shorter side left-padded with masked slots)."""
        self.check_batchable()
        self.slots.join(other.slots.buffers, other.length)

    @torch.inference_mode()
    def extract(self, i: int) -> "TorchTarget":
        """Row i alone on a cache of its own (its valid slots, in order): a prefix kept after it leaves the batch."""
        row = self.spawn()
        self.slots.extract(i, row.slots)
        return row

    def cache_bytes(self) -> int:
        return sum(t.nbytes for layer in self.cache.layers for t in (layer.keys, layer.values)
                   if isinstance(t, torch.Tensor))

    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        self.slots.select(rows)

    # ---- internals ---------------------------------------------------------------------------------------------------
    def _batch_refusal(self) -> str | None:
        if self.cache_len is not None:
            return "--batch-size: batched decoding runs on the dynamic cache; drop --compile / cache_len"
        if self.rewind is not None:
            return SLIDING_BATCH_REFUSAL
        return None

    def check_batchable(self) -> None:
        refusal = self._batch_refusal()
        if refusal:
            raise DFlashError(refusal)

    def _new_cache(self):
        if self.cache_len is None:
            cache = DynamicCache(config=self.model.config)
            if bounded_layers(cache):  # (transformers' own layers: CacheRewind restores their tensors)
                if self.rewind is None:
                    self.rewind = CacheRewind(self.model)
                self.rewind.attach(cache)
                return cache
            return growing(cache, self.max_context)
        static = windowed(StaticCache(config=self.model.config, max_cache_len=self.cache_len))
        if bounded_layers(static):
            raise DFlashError(f"{self.info.model_type}: a static cache (cache_len / --compile) cannot rewind this "
                              "target's sliding-window or linear-attention layers; use the dynamic cache")
        return static
