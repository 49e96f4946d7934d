"""Self-prompted answers at batch scale: many lanes, one position-indexed static cache, refilled as they finish.

Each lane writes a user's request itself (Magpie, arXiv 2406.08464: the chat template's user-turn prefix, sampled
until the model ends its turn) and then answers it, in one running sequence: system turn, request, the template's
assistant header (forced), answer. All lanes step together, one token each, on transformers' model with a cache
whose K/V live in fixed (lanes, heads, capacity, head_dim) buffers; every lane writes at its own position, so a lane
that finishes is refilled at once with a fresh copy of the system turn's K/V (computed once) while the others go on.
Nothing is padded and nothing waits for the batch's longest answer, as it does in `generate()`.

A lane's request is dropped (and the lane refilled) when it is too long, empty, already written, or copies a prompt
of the `exclude` files (the benchmark split). Answers are greedy or sampled (temperature `answer_temperature`), per
lane, drawn with `sampled_fraction`. Sampling keeps the `SAMPLE_TOP_K` most likely tokens, then the nucleus of mass
top_p within them: the full-vocabulary sort a nucleus needs costs more than the step on a CPU at this batch.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from dflash.core.errors import DFlashError
from dflash.core.extras.blas import cpu_has_native_bf16
from dflash.core.io import check_output_dir
from dflash.core.model_files.tokenizer import eos_token_ids, load_tokenizer
from dflash.core.training.answer_shards import (AnswerRow, count, read_rows, shard_paths, write_manifest,
                                                write_shard)

from .self_prompts import SENTINEL, excluded_prompts, normalise, user_turn_prefix, word_runs
from .target import load_target, resolve_device, resolve_dtype

SAMPLE_TOP_K = 64
# Lanes are re-ordered by length every SORT_EVERY steps and attend in WINDOW_GROUPS groups of neighbours, each over
# its longest member's slots: the cache read is memory-bound, and one window over every lane reads the longest
# lane's length for all (2-3x what they hold when lanes are of every age)
SORT_EVERY = 32
WINDOW_GROUPS = 8


class LaneLayer(CacheLayerMixin):
    """One layer's K/V in (lanes, heads, capacity, head_dim) buffers; a forward of one token per lane writes lane i's
    entry at slot `cache.slots[i]` and attends over the first `cache.window` slots (its mask says which it sees)."""

    is_compileable = False

    def __init__(self, cache: "LaneCache", k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.cache, self.k, self.v = cache, k, v
        self.keys, self.values, self.device, self.is_initialized = k, v, k.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated whole up front

    def update(self, key_states, value_states, *args, **kwargs):
        lanes, slots = self.cache.write_index(key_states.shape[0], key_states.shape[2])
        self.k[lanes, :, slots] = key_states.transpose(1, 2)
        self.v[lanes, :, slots] = value_states.transpose(1, 2)
        return self.k[:, :, :self.cache.window], self.v[:, :, :self.cache.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.window, 0

    def get_seq_length(self) -> int:
        return self.cache.window

    def get_max_length(self) -> int:
        return self.cache.capacity


class LaneCache(Cache):
    """The lanes' K/V. `slots` (lanes,) is where each lane's next token goes; `window` how many slots a step
    attends over (its mask hides each lane's slots past its own)."""

    def __init__(self, config, lanes: int, capacity: int, device, dtype: torch.dtype):
        self.lanes, self.capacity = lanes, capacity
        self.slots = torch.zeros(lanes, dtype=torch.long, device=device)
        self.window = capacity
        self._lane_rows = torch.arange(lanes, device=device)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (lanes, config.num_key_value_heads, capacity, head_dim)
        self.lane_layers = [LaneLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device))
                            for _ in range(config.num_hidden_layers)]
        super().__init__(layers=list(self.lane_layers))

    def write_index(self, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert rows == self.lanes and tokens == 1, "a step feeds one token to every lane"
        return self._lane_rows[:, None], self.slots[:, None]

    def reorder(self, order: torch.Tensor) -> None:
        """Lane i takes what lane order[i] held."""
        for layer in self.lane_layers:
            layer.k, layer.v = layer.k[order], layer.v[order]
            layer.keys, layer.values = layer.k, layer.v
        self.slots = self.slots[order]

    def copy_in(self, lane: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Lane `lane` takes the K/V `kv` (per layer: (heads, T, head_dim) keys and values) in slots 0..T-1."""
        for layer, (k, v) in zip(self.lane_layers, kv):
            layer.k[lane, :, :k.shape[1]] = k
            layer.v[lane, :, :v.shape[1]] = v


@dataclass
class Lane:
    system: int  # which system turn it writes under
    tokens: list[int] = field(default_factory=list)  # after the system prefix
    phase: str = "prompt"  # "prompt" -> "header" (forced assistant header) -> "answer"
    answer_start: int = 0
    sampled: bool = False
    forced: list[int] = field(default_factory=list)


def sample_step(logits: torch.Tensor, temperature: torch.Tensor, top_p: float, generator: torch.Generator):
    """Per lane: argmax where temperature == 0, else a draw from the top SAMPLE_TOP_K tokens' nucleus of mass top_p
    at that temperature (Gumbel-max over the kept tokens). One top-k serves both (a full argmax costs as much again):
    the argmax is the lowest index among the top-k entries equal to the largest, as torch.argmax breaks ties."""
    top, idx = logits.topk(SAMPLE_TOP_K, dim=-1)
    top = top.float()
    tied = top == top[:, :1]
    greedy = torch.where(tied, idx, torch.full_like(idx, logits.shape[-1])).min(-1).values
    probs = torch.softmax(top / temperature.clamp_min(1e-4)[:, None], dim=-1)
    keep = probs.cumsum(-1) - probs < top_p  # the smallest prefix of mass >= top_p
    gumbel = -torch.empty_like(probs).exponential_(generator=generator).log()
    scores = torch.where(keep, probs.log() + gumbel, torch.full_like(probs, -torch.inf))
    drawn = idx.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, drawn, greedy)


@dataclass
class Settings:
    max_prompt_tokens: int = 96  # a request that has not ended by then is dropped
    max_answer_tokens: int = 384  # an answer is cut here (kept, marked unfinished)
    prompt_temperature: float = 1.0
    answer_temperature: float = 0.7  # for the sampled answers
    top_p: float = 0.95
    sampled_fraction: float = 0.25  # of answers sampled at answer_temperature (the rest greedy)
    min_prompt_chars: int = 16


class AnswerLanes:
    """`lanes` conversations decoded together; `step()` advances each by one token and returns the rows that
    finished. A finished or dropped lane starts a new conversation at once (under a system turn drawn by weight)."""

    def __init__(self, model, tokenizer, systems: list[str | None], weights: list[float], end_of_turn: set[int],
                 accept_prompt, *, lanes: int, settings: Settings, seed: int = 0):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.accept_prompt = accept_prompt  # prompt text -> reason it is dropped, or None
        self.end_of_turn = end_of_turn
        device = next(model.parameters()).device
        self.rng = torch.Generator(device=device).manual_seed(seed)
        self.pick = torch.Generator().manual_seed(seed + 1)
        self.weights = torch.tensor(weights, dtype=torch.float)
        self.prefixes = [tokenizer(user_turn_prefix(tokenizer, s), add_special_tokens=False)["input_ids"]
                         for s in systems]
        self.header = assistant_header(tokenizer, end_of_turn)
        capacity = max(map(len, self.prefixes)) + settings.max_prompt_tokens + len(self.header) + \
            settings.max_answer_tokens + 1
        self.cache = LaneCache(model.config, lanes, capacity, device, next(model.parameters()).dtype)
        self.prefix_kv = [self._prefill(p[:-1]) for p in self.prefixes]
        self.lanes = [Lane(system=0) for _ in range(lanes)]
        self.next_input = torch.zeros(lanes, dtype=torch.long, device=device)
        self.temperature = torch.zeros(lanes, device=device)
        self.dropped: dict[str, int] = {}
        self.tokens_fed = self.steps = 0
        self._restart(list(range(lanes)))

    @torch.inference_mode()
    def _prefill(self, ids: list[int]):
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=torch.tensor([ids], device=self.cache.slots.device), cache=cache, use_cache=True,
                   logits_to_keep=1)
        layers = [layer for layer in cache.layers if isinstance(layer, DynamicLayer)]
        assert len(layers) == len(cache.layers), "full-attention layers only"
        return [(layer.keys[0], layer.values[0]) for layer in layers if layer.keys is not None and
                layer.values is not None]

    def _restart(self, lanes: list[int]) -> None:
        """Fresh conversations in `lanes`: a system turn drawn by weight, its K/V copied in, its last token next."""
        if not lanes:
            return
        systems = torch.multinomial(self.weights, len(lanes), replacement=True, generator=self.pick).tolist()
        sampled = (torch.rand(len(lanes), generator=self.pick) < self.settings.sampled_fraction).tolist()
        for lane, s, draw in zip(lanes, systems, sampled):
            self.lanes[lane] = Lane(system=s, sampled=draw)
            prefix = self.prefixes[s]
            self.cache.copy_in(lane, self.prefix_kv[s])
            self.cache.slots[lane] = len(prefix) - 1
            self.next_input[lane] = prefix[-1]
            self.temperature[lane] = self.settings.prompt_temperature

    def _sort_lanes(self) -> None:
        """Lanes in order of length (longest first), so that neighbours share a window."""
        order = torch.argsort(self.cache.slots, descending=True, stable=True)
        self.cache.reorder(order)
        self.lanes = [self.lanes[i] for i in order.tolist()]
        self.next_input, self.temperature = self.next_input[order], self.temperature[order]

    def _row_windows(self) -> list[tuple[int, int, int]]:
        n, size = len(self.lanes), -(-len(self.lanes) // WINDOW_GROUPS)
        slots = self.cache.slots
        return [(a, min(a + size, n), int(slots[a:a + size].max()) + 1) for a in range(0, n, size)]

    @torch.inference_mode()
    def step(self) -> list[AnswerRow]:
        cache, n = self.cache, len(self.lanes)
        if self.steps % SORT_EVERY == 0:
            self._sort_lanes()
        self.steps += 1
        windows = self._row_windows()
        cache.window = max(w for _, _, w in windows)
        visible = torch.arange(cache.window, device=cache.slots.device)[None] <= cache.slots[:, None]
        out = self.model(input_ids=self.next_input[:, None], position_ids=cache.slots[:, None],
                         attention_mask=visible[:, None, None], cache=cache, use_cache=True, logits_to_keep=1,
                         row_windows=windows)
        drawn = sample_step(out.logits[:, -1], self.temperature, self.settings.top_p, self.rng).tolist()
        cache.slots += 1
        self.tokens_fed += n
        feed = self.next_input.tolist()
        finished, restart = [], []
        for i, (lane, token) in enumerate(zip(self.lanes, drawn)):
            if lane.phase == "header":
                if lane.forced:  # feed the template's assistant header, token by token
                    token = lane.forced.pop(0)
                    lane.tokens.append(token)
                    feed[i] = token
                    if not lane.forced:
                        lane.phase, lane.answer_start = "answer", len(lane.tokens)
                        self.temperature[i] = self.settings.answer_temperature if lane.sampled else 0.0
                    continue
            lane.tokens.append(token)
            feed[i] = token
            if lane.phase == "prompt":
                reason = self._end_of_prompt(lane, token)
                if reason is not None:
                    self.dropped[reason] = self.dropped.get(reason, 0) + 1
                    restart.append(i)
            elif lane.phase == "answer":
                ended = token in self.end_of_turn
                if ended or len(lane.tokens) - lane.answer_start >= self.settings.max_answer_tokens:
                    prefix = self.prefixes[lane.system]
                    finished.append(AnswerRow(prefix + lane.tokens, len(prefix) + lane.answer_start, lane.sampled,
                                              ended, lane.system))
                    restart.append(i)
        self.next_input = torch.tensor(feed, device=self.next_input.device)
        self._restart(restart)
        return finished

    def _end_of_prompt(self, lane: Lane, token: int) -> str | None:
        """After a request's token: why the request is dropped, or None (going on, or ended and accepted)."""
        if token not in self.end_of_turn:
            return "too long" if len(lane.tokens) >= self.settings.max_prompt_tokens else None
        if token != self.header[0]:
            return "ended oddly"
        text = self.tokenizer.decode(lane.tokens[:-1], skip_special_tokens=True).strip()
        if len(text) < self.settings.min_prompt_chars:
            return "too short"
        reason = self.accept_prompt(text)
        if reason is None:
            lane.phase, lane.forced = "header", list(self.header[1:])
        return reason


def assistant_header(tokenizer, end_of_turn: set[int]) -> list[int]:
    """The tokens between a user's words and the assistant's: the end-of-turn token first, then the header."""
    turns = [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text[text.index(SENTINEL) + len(SENTINEL):], add_special_tokens=False)["input_ids"]
    if not ids or ids[0] not in end_of_turn:
        raise DFlashError("the chat template's user turn does not end on an end-of-turn token; cannot write "
                          "self-prompted answers with it")
    return ids


# The system turns requests are written under, and how often: the template's own, and three that steer the requests
# towards code, arithmetic and writing (the answers keep the system turn they were written under).
SYSTEMS: list[tuple[str | None, float]] = [
    (None, 0.55),
    ("You are an expert Python programmer. Users ask you to write, explain and fix Python code.", 0.2),
    ("You are a patient math tutor. Users ask you arithmetic, algebra and word problems, which you solve step by "
     "step.", 0.1),
    ("You are a helpful writing assistant. Users ask you to write, rewrite, summarise and explain texts.", 0.15),
]


def batch_dtype(name: str, device: str) -> torch.dtype:
    """--dtype auto for batched work: bfloat16 on CUDA and on CPUs that multiply it in hardware (~2x float32 at this
    batch there); float32 elsewhere (AVX2 emulates bfloat16, many times slower)."""
    if name == "auto" and device == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return resolve_dtype(name, device)


def write_answers(model_dir, out_dir, *, answers: int, lanes: int = 128, settings: Settings | None = None,
                  exclude=(), seed: int = 0, shard_rows: int = 256, device: str = "auto", dtype: str = "auto",
                  trust_remote_code: bool = False, progress: bool = True, log=print) -> dict:
    """Self-prompted answers into numbered shards of `out_dir` until it holds `answers` rows; resumable (a rerun
    continues after the last whole shard, with fresh seeds, and never writes a request already there)."""
    settings = settings or Settings()
    out_dir = Path(out_dir)
    check_output_dir(out_dir, "--out")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError(f"{model_dir}: the tokenizer has no chat_template; self-written requests need one")
    systems = [s for s, _ in SYSTEMS]
    write_manifest(out_dir, {"model": Path(model_dir).name, "systems": systems, "weights": [w for _, w in SYSTEMS],
                             "settings": asdict(settings), "lanes": lanes})
    end_of_turn = set(eos_token_ids(model_dir, tokenizer))
    header = assistant_header(tokenizer, end_of_turn)
    prefixes = [tokenizer(user_turn_prefix(tokenizer, s), add_special_tokens=False)["input_ids"] for s in systems]

    seen = {normalise(tokenizer.decode(r.ids[len(prefixes[r.system]):r.answer_start - len(header)],
                                     skip_special_tokens=True)) for r in read_rows(out_dir)}
    done, shard = len(seen), len(shard_paths(out_dir))
    if done >= answers:
        return dict(count(out_dir), written=0)
    excluded, excluded_runs = excluded_prompts(exclude)

    def accept(text: str) -> str | None:
        key = normalise(text)
        if key in seen:
            return "already written"
        if key in excluded or word_runs(text) & excluded_runs:
            return "benchmark overlap"
        seen.add(key)
        return None

    device = resolve_device(device)
    model = load_target(model_dir, batch_dtype(dtype, device), device, trust_remote_code)
    writer = AnswerLanes(model, tokenizer, systems, [w for _, w in SYSTEMS], end_of_turn, accept, lanes=lanes,
                         settings=settings, seed=seed * 1_000_003 + shard)
    bar = tqdm(total=answers, initial=done, desc="answers", unit="ans", dynamic_ncols=True, disable=not progress)
    rows: list[AnswerRow] = []
    written, answer_tokens, start = 0, 0, time.perf_counter()

    def flush() -> None:
        nonlocal shard, rows
        if rows:
            write_shard(out_dir, shard, rows, model.config.vocab_size)
            if not progress:  # a line a shard where no bar shows (a background job's log)
                log(f"shard {shard}: {done} answers in all, {answer_tokens} answer tokens in this run "
                    f"({answer_tokens / (time.perf_counter() - start):.0f} a second)")
            shard, rows = shard + 1, []

    def stop(signum, frame):  # a kill (SIGTERM), and Ctrl-C where a background shell ignores SIGINT
        raise KeyboardInterrupt

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while done < answers:
            for row in writer.step():
                if done >= answers:
                    break
                rows.append(row)
                done, written = done + 1, written + 1
                answer_tokens += len(row.ids) - row.answer_start
                bar.update(1)
            bar.set_postfix_str(f"{answer_tokens / (time.perf_counter() - start):.0f} answer tok/s", refresh=False)
            if len(rows) >= shard_rows:
                flush()
    except KeyboardInterrupt:
        log(f"interrupted: keeping the {len(rows)} answers of the shard under way; rerun to continue")
    finally:
        flush()
        bar.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    seconds = time.perf_counter() - start
    log(f"answers: {written} written in {seconds:.0f} s ({answer_tokens / seconds:.0f} answer tokens/s, "
        f"{writer.tokens_fed / seconds:.0f} tokens fed/s); requests dropped: {writer.dropped}")
    return dict(count(out_dir), written=written, seconds=round(seconds, 1), dropped=writer.dropped)
