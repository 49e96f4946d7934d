"""The array primitives a backend gives the engine (dflash/core/engine.py). Policy (what to commit, when to stop, prefix
reuse, per-row bookkeeping) lives in the core; a backend owns models, caches and arrays, nothing else.

A backend package exposes `load(target_dir, draft_dir, **options) -> Engine`, an Engine built over a Target and,
with a drafter, a Drafter. Arrays are the framework's own (torch.Tensor, mx.array) and stay on the device; the
engine reads back to the host once per cycle, through `to_host`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from dflash.core.contract import Draft, Pending
from dflash.core.sampling import RowDraw, SamplingParams
from dflash.core.spec import TargetInfo
from dflash.core.tree import TreeInputs


class Target(Protocol):
    info: TargetInfo
    max_context: int | None

    # arrays
    def ids(self, rows: Sequence[Sequence[int]]): ...                       # host ids (rows, T) -> device
    def cat(self, parts: list): ...                                         # along the sequence axis
    def head(self, features, n: int): ...                                   # the first n positions
    def take_rows(self, features, rows: list[int]): ...
    def pad_rows(self, features, n: int): ...                               # n more rows of zeros
    def to_host(self, x) -> list[list[int]]: ...
    def settle(self, drafter=None, *arrays) -> None: ...                    # evaluate lazy state (MLX)

    # sampling: the target's token at each position, as target-only decoding would draw it
    def set_sampling(self, params: SamplingParams) -> None: ...            # every row; spawn/merge/select keep
    # each row's own settings; sample: (rows, T, V) -> (rows, T), each row drawn with its RowDraw's noise (draws
    # None: all greedy), rejection rows verifying the draft's sampled proposals (Draft.q_ids / q_probs); with
    # logprobs=k also (chosen, top-k ids, top-k log-probs), each (rows, T[, k]), of the distributions drawn from
    def sample(self, logits, histories: list[list[int]], block, paths=None, logprobs: int | None = None,
               draws: list[RowDraw] | None = None, draft: Draft | None = None): ...
    def gumbel(self, keys: list[int]): ...                                  # (len(keys), V) noise, a row per key

    # the model and its cache
    def forward(self, ids, last_only: bool, tree: TreeInputs | None = None) -> tuple: ...  # -> (logits, features)
    def keep(self, keeps: list[int], width: int) -> bool: ...              # row i keeps its first keeps[i] of them
    def trim(self, n: int) -> bool: ...                                    # one row: forget the last n (False: cannot)
    def reset(self) -> None: ...
    def close(self) -> None: ...

    # trees (dflash/core/tree.py): a forward with `tree` puts slot j at position + depth under an ancestor mask
    def tree_refusal(self) -> str | None: ...                              # why this target cannot (None: it can)
    def device_key(self) -> str: ...                                       # device, dtype, threads (dflash/core/costs.py)
    def keep_slots(self, slots: list[list[int]], width: int) -> None: ...  # row i keeps slots[i] of the last forward
    def gather(self, features, slots: list[list[int]]): ...                # row i's features at slots[i], packed

    # rows
    def check_batchable(self) -> None: ...                                 # one line if rows cannot share this cache
    def spawn(self) -> "Target": ...                                       # same model, empty cache (a joining row)
    def merge(self, other: "Target") -> None: ...                          # append other's rows
    def select(self, rows: list[int]) -> None: ...                         # keep only these rows


class Drafter(Protocol):
    position: int  # row 0's context length (= its anchor's position)
    distribution: bool  # True: its selector has a proper draft distribution of its own (DFlash2)

    def extend(self, pending: Pending | None) -> None: ...                 # absorb context without drafting (prefill)
    # proposals per row by its draw: greedy rows the argmax; match rows argmax(warped logits + the target's own
    # Gumbel noise); rejection rows a sample of q (returned as Draft.q_ids / q_probs); with top_k the per-position
    # candidates (greedy: by probability; sampled: by the noise-perturbed score)
    def propose(self, anchor_ids, pending: Pending | None, block_size: int, top_k: int = 0,
                draws: list[RowDraw] | None = None) -> Draft: ...
    def crop(self, position: int) -> bool: ...
    def reset(self) -> None: ...
    def spawn(self) -> "Drafter": ...
    def merge(self, other: "Drafter") -> None: ...
    def select(self, rows: list[int]) -> None: ...
