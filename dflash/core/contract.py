"""What the engine and a backend promise each other: the Target and Drafter interfaces the engine is typed against,
the values a cycle hands between them (draft -> Draft, verify -> Verified, commit(verified, keeps)), and the
capabilities a backend declares for applications to read. Every backend runs tests/test_contract.py against it.

Arrays are the framework's own (torch.Tensor, mx.array) and stay on the device; the engine reads back to the host
once per cycle, through `to_host`. Policy (what to commit, when to stop, prefix reuse, per-row bookkeeping) lives in
the core; a backend owns models, caches and arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from typing import Self  # (3.11)

    from .sampling import RowDraw, RowSampling
    from .spec import DraftSpec, TargetInfo
    from .tree import TreeInputs

Array = Any  # a backend's device array (torch.Tensor, mx.array): the core hands it on, never looks inside


@dataclass
class Pending:
    """Target features (rows, m, K*H) the drafter has not read yet; row i's first counts[i] are real."""

    features: Array
    counts: list[int]


@dataclass
class Draft:
    """One draft forward's output, on the device: `ids` (rows, B) = [anchor, proposals], and per block position
    the drafter's top-k token ids and probabilities (rows, B-1, k), when asked for (tree verification)."""

    ids: Array
    top_ids: Array = None
    top_probs: Array = None
    # when the drafter sampled its proposals (rejection verification): per proposal the candidate ids and the draft
    # distribution q over them (rows, B-1, k), in the cycle's shape (q sharpened, or one-hot at the argmax)
    q_ids: Array = None
    q_probs: Array = None


@dataclass
class Verified:
    """One verify forward, per row: the block it read ([anchor, proposals]) and the target's token at each of those
    positions, on the host; the forward's target features (on the device) for the drafter's context; with
    Engine.logprobs set, per position the chosen token's log-probability and the top (id, log-probability) pairs."""

    blocks: list[list[int]]
    tokens: list[list[int]]
    features: Array = None
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    @property
    def proposals(self) -> list[list[int]]:
        return [block[1:] for block in self.blocks]


@dataclass
class Step:
    """One row's cycle: the tokens it committed (accepted draft tokens, then the target's own token) and what the
    target verified for it."""

    tokens: list[int]
    drafted: list[int]  # the proposals the target checked (chain), or the accepted path's (tree)
    verified: int  # draft tokens the target verified for this row
    draft_forward: bool = True  # False: a cycle of --verify auto that verified without drafting
    # with Engine.logprobs set: per committed token, the target's log-probability of it under
    # the row's sampling settings and the top (id, log-probability) pairs, from the verify forward's own logits
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True)
class Capabilities:
    """What a target can do, declared by its backend: applications read this, never a backend's name. A refusal is
    the one line that says why not (None: it can)."""

    batch_refusal: str | None = None  # rows sharing its caches: batches, continuous batching, kept prefixes
    tree_refusal: str | None = None  # a tree of drafts verified in one forward (positions + ancestor mask)
    compiles: bool = False  # its forwards compile at the first sight of a shape (time them after a warm-up)

    @property
    def batches(self) -> bool:
        return self.batch_refusal is None

    @property
    def trees(self) -> bool:
        return self.tree_refusal is None


class Target(Protocol):
    info: TargetInfo
    max_context: int | None

    @property
    def capabilities(self) -> Capabilities: ...

    # arrays
    def ids(self, rows: list[list[int]]): ...                               # host ids (rows, T) -> device
    def cat(self, parts: list): ...                                         # along the sequence axis
    def head(self, features, n: int): ...                                   # the first n positions
    def take_rows(self, features, rows: list[int]): ...
    def pad_rows(self, features, n: int): ...                               # n more rows of zeros
    def to_host(self, x) -> list[Any]: ...
    def settle(self, drafter: Drafter | None = None, *arrays) -> None: ...  # evaluate lazy state (MLX): drafter.state()

    # sampling: the target's token at each position, as target-only decoding would draw it. A target holds no
    # per-row settings: each step brings them, as vLLM's batch metadata does. (rows, T, V) -> (rows, T): row i
    # drawn under rows[i] (its SamplingParams; its output starts at histories[i][rows[i].prompt_tokens], which
    # presence and frequency penalties count) with its RowDraw's noise (draws None: all greedy), rejection rows
    # verifying the draft's sampled proposals (Draft.q_ids / q_probs), multi rows in a tree their nodes' children
    # (RowDraw.children: dflash.core.rules.multi_candidate_tokens); with logprobs=k also (chosen, top-k ids, top-k
    # log-probs), each (rows, T[, k]), of the distributions drawn from. Position j of row i follows histories[i] +
    # block[i][:j+1] (a tree: + paths[i][j]). Greedy rows without processors (SamplingParams.processors) and no
    # log-probs: one argmax for the batch
    def sample(self, logits, histories: list[list[int]], block, rows: Sequence[RowSampling], paths=None,
               logprobs: int | None = None, draws: list[RowDraw] | None = None, draft: Draft | None = None): ...
    def gumbel(self, keys: list[int]): ...                                  # (len(keys), V) noise, a row per key

    # the model and its cache
    def forward(self, ids, last_only: bool, tree: TreeInputs | None = None) -> tuple: ...  # -> (logits, features)
    def keep(self, keeps: list[int], width: int) -> bool: ...              # row i keeps its first keeps[i] of them
    # one row: forget the last n; False (nothing changed) past what its cache can go back to (bounded layers: the
    # last forward), and the engine starts over: asking is cheap, and only the cache knows how far it reaches
    def trim(self, n: int) -> bool: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...

    # trees (tree.py): a forward with `tree` puts slot j at position + depth under an ancestor mask
    def keep_slots(self, slots: list[list[int]], width: int) -> None: ...  # row i keeps slots[i] of the last forward
    def gather(self, features, slots: list[list[int]]): ...                # row i's features at slots[i], packed

    # rows (capabilities.batches)
    def spawn(self) -> Self: ...                                           # same model, empty cache (a joining row)
    def merge(self, other: Self) -> None: ...                              # append other's rows
    def select(self, rows: list[int]) -> None: ...                         # keep only these rows
    def extract(self, row: int, /) -> Self: ...                            # row `row` alone, its cache copied out
    def cache_bytes(self) -> int: ...                                      # what its caches hold (prefix cache)


@runtime_checkable
class Pipelining(Protocol):
    """What a target whose arrays are lazy (MLX) may add to Target: `start` computes them in the background, so that
    a plain step's next forward runs while the host reads this one's tokens (dflash/core/lookahead.py). A target
    without it runs each step in turn (torch: CUDA already queues its kernels ahead of the host)."""

    def start(self, *arrays) -> None: ...


class Drafter(Protocol):
    @property
    def position(self) -> int: ...  # row 0's context length (= its anchor's position)
    @property
    def distribution(self) -> bool: ...  # True: its selector has a proper draft distribution of its own (DFlash2)
    @property
    def spec(self) -> DraftSpec: ...  # its checkpoint's shape
    @property
    def drafts_some_rows(self) -> bool: ...  # propose(rows=...) runs the draft forward for those rows only

    def extend(self, pending: Pending | None) -> None: ...                 # absorb context without drafting (prefill)
    # proposals per row by its draw: greedy rows the argmax; match rows argmax(warped logits + the target's own
    # Gumbel noise); rejection rows a sample of q in the cycle's shape (returned as Draft.q_ids / q_probs); with
    # top_k the per-position candidates (greedy and multi: by probability; matched: by the noise-perturbed score).
    # rows: greedy blocks of these rows of its cache only (anchor_ids theirs, no pending: extend took it)
    def propose(self, anchor_ids, pending: Pending | None, block_size: int, top_k: int = 0,
                draws: list[RowDraw] | None = None, rows: list[int] | None = None) -> Draft: ...
    def crop(self, position: int) -> bool: ...
    def reset(self) -> None: ...
    def state(self) -> list: ...  # its cache's arrays, for Target.settle to evaluate (lazy backends; eager: [])
    def spawn(self) -> Self: ...
    def merge(self, other: Self) -> None: ...
    def select(self, rows: list[int]) -> None: ...
    def extract(self, row: int, /) -> Self: ...
    def cache_bytes(self) -> int: ...
