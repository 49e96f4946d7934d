"""The Python API:

    import dflash
    pipe = dflash.load("Qwen/Qwen3-8B")                  # drafter from the registry; no args = bundled pair
    print(pipe.generate("Write a haiku", chat=True).text)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from . import backends, hub
from .core.extras import blas
from .core.budget import ITL_LIMIT, VERIFY_MODES
from .core.model_files.checkpoint import check_target_dir
from .core.engine import Engine
from .core.errors import DFlashError
from .core.progress import Heartbeat
from .core.loop import Generation, GenerationResult, Increment, generate_batch
from .core.sampling import SamplingParams
from .core.spec import DraftSpec
from .core.model_files.tokenizer import chat_ids, eos_token_ids, load_tokenizer

# --compile's default static cache: preallocated whole (K/V of every layer), so not the full context of a
# long-context model (SmolLM2: 8192) unless asked for with --cache-len
COMPILED_CACHE_LEN = 2048


class Pipeline:
    """An engine (a target and an optional drafter on one backend, `backend_name`) and the target's tokenizer."""

    def __init__(self, engine: Engine, tokenizer, target_dir: Path, draft_dir: Path | None, backend_name: str):
        self.engine, self.tokenizer = engine, tokenizer
        self.target_dir, self.draft_dir, self.backend_name = target_dir, draft_dir, backend_name
        self.eos_token_ids = eos_token_ids(target_dir, tokenizer)

    def encode(self, prompt: str | Sequence[int], chat: bool = False, system: str | None = None,
               enable_thinking: bool | None = None) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if chat:
            return chat_ids(self.tokenizer, [{"role": "user", "content": prompt}], system, enable_thinking)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def stream(self, prompt: str | Sequence[int], *, chat: bool = False, max_new_tokens: int = 256,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), trace: bool = False,
               **sampling_kwargs) -> Generation:
        """An iterable of `Increment`s; `.result` is filled once it is exhausted."""
        sampling = (sampling or SamplingParams(**sampling_kwargs)).validate(self.engine.info.vocab_size)
        ids = self.encode(prompt, chat=chat)
        max_new_tokens = self.fit_to_context(max_new_tokens, len(ids))
        return Generation(self.engine, ids, tokenizer=self.tokenizer, max_new_tokens=max_new_tokens,
                          sampling=sampling, eos_token_ids=self.eos_token_ids, stop_strings=stop, trace=trace)

    def fit_to_context(self, max_new_tokens: int, prompt_tokens: int) -> int:
        """max_new_tokens, capped with one line on stderr so that prompt + generation stay within the target's
        context (past max_position_embeddings a model's output is untrained territory, not an error)."""
        max_context = self.engine.max_context
        room = max_context - prompt_tokens if max_context else None
        if room is None or room < 1 or max_new_tokens <= room:  # room < 1: prefill refuses the prompt itself
            return max_new_tokens
        print(f"dflash: --max-new-tokens {max_new_tokens} capped to {room}: the prompt's {prompt_tokens} tokens "
              f"leave {room} of the target's context (max_position_embeddings {max_context})", file=sys.stderr,
              flush=True)
        return room

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        return self.stream(prompt, **kwargs).run()

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False, max_new_tokens: int = 256,
                       sampling: SamplingParams | None = None, stop: Sequence[str] = (), trace: bool = False,
                       **sampling_kwargs) -> list[GenerationResult]:
        """All prompts in one batch (PyTorch backend): every cycle drafts and verifies all unfinished rows at once,
        each row accepting its own prefix; greedy row i equals generate(prompts[i]). The engine's caches then hold
        the batch, so the next single prompt is prefilled from scratch."""
        if not self.engine.capabilities.batches:
            raise DFlashError(self.engine.capabilities.batch_refusal)
        sampling = (sampling or SamplingParams(**sampling_kwargs)).validate(self.engine.info.vocab_size)
        return generate_batch(self.engine, [self.encode(p, chat=chat) for p in prompts], tokenizer=self.tokenizer,
                              max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=self.eos_token_ids,
                              stop_strings=stop, trace=trace)


def load(model: str | os.PathLike | None = None, draft: str | os.PathLike | None = None, *, backend: str = "auto",
         no_draft: bool = False, dtype: str = "auto", device: str = "auto", block_size: int | None = None,
         draft_window: int | None = None, trust_remote_code: bool = False, verify: str = "auto",
         tree_budget: int | None = None, copy_branch: bool = True, itl_limit: float | None = ITL_LIMIT,
         compile: bool = False, cache_len: int | None = None) -> Pipeline:
    """verify: chain (the drafter's B-1 proposals), tree (`tree_budget` nodes of the most probable prefixes each
    cycle) or auto (each cycle the node count that maximises tokens per second on this device, at the seconds its
    own cycles took: nothing is measured at load; see dflash/core/budget.py). itl_limit (auto): a cycle takes at
    most this many plain steps per token any of its rows expects, so that in a batch a row whose drafts are rarely
    accepted is not slowed down by the others' trees (None or 0: no limit). compile (torch): the target's K/V in a preallocated static
    cache of `cache_len` positions (default: the target's context, at most COMPILED_CACHE_LEN) and the decoding
    forwards through torch.compile, compiled at load; one stream (batches need the dynamic cache)."""
    name = backends.pick(backend)  # cheap checks first: a bad flag or config costs no model load
    if verify not in VERIFY_MODES:
        raise DFlashError(f"--verify: got {verify!r}, expected one of {', '.join(VERIFY_MODES)}")
    if tree_budget is not None and tree_budget < 1:
        raise DFlashError(f"--tree-budget: got {tree_budget}, expected >= 1 draft nodes")
    if itl_limit is not None and itl_limit != 0 and not itl_limit >= 1:
        raise DFlashError(f"--itl-limit: got {itl_limit}, expected 0 (no limit) or >= 1 plain steps per token")
    if cache_len is not None and not compile:
        raise DFlashError("--cache-len: sizes the static cache of --compile; add --compile or drop it")
    if cache_len is not None and cache_len < 1:
        raise DFlashError(f"--cache-len: got {cache_len}, expected >= 1 positions")
    if compile and name != "torch":
        raise DFlashError(f"--compile: a torch option (static cache + torch.compile); the {name} backend runs "
                          "without it")
    if model is not None:
        pair = hub.pair_for(str(model))  # refuse a known-unsupported family before downloading it
        if pair is not None and not no_draft and name not in pair.backends:
            raise DFlashError(f"--model: {pair.target} is not supported by the {name} backend "
                              f"for speculative decoding ({pair.note or 'see python -m dflash.models'}); "
                              "--no-draft runs it without a drafter")
    target_dir, draft_dir = hub.resolve_pair(model, draft, want_draft=not no_draft)
    # every check once, here, before any framework reads a file: config.json and safetensors headers of the target,
    # the drafter's config.json; the backend then only checks what needs the loaded model (spec vs target)
    target_config = check_target_dir(target_dir)
    spec = DraftSpec.load(draft_dir) if draft_dir is not None else None
    package = backends.get(name)  # one line if its library is missing
    if name == "mlx":
        blas.tell_once(blas.advice(blas.mlx_blas()))  # the inputs are fine: say why this run will be slow
    tokenizer = load_tokenizer(target_dir, trust_remote_code)
    extra: dict = {}
    if compile:
        text = target_config["text_config"] if isinstance(target_config.get("text_config"), dict) else target_config
        cache_len = cache_len or min(text.get("max_position_embeddings") or COMPILED_CACHE_LEN, COMPILED_CACHE_LEN)
        extra = {"compile": True, "cache_len": cache_len}
        print(f"dflash: --compile: a static cache of {cache_len} positions; compiling its forwards (a minute or two "
              "on a CPU, less once torch's compile cache holds them)", file=sys.stderr)
    label = str(model) if model is not None else "the bundled pair"
    # (loading and compiling are silent for seconds, tens of them under load)
    with Heartbeat(f"loading {label}" + (" and compiling its forwards" if compile else "")):
        be = package.load(target_dir, draft_dir, dtype=dtype, device=device, block_size=block_size,
                          draft_window=draft_window, trust_remote_code=trust_remote_code, spec=spec,
                          target_config=target_config, **extra)
        if len(tokenizer) > be.info.vocab_size:
            raise DFlashError(f"{target_dir}: the tokenizer has {len(tokenizer)} tokens but the target's embedding "
                              f"table has {be.info.vocab_size} rows (a tokenizer of another model?)")
        if draft_dir is not None and verify != "chain":
            be.set_verify(verify, tree_budget, None, copy_branch, itl_limit or None)
    return Pipeline(be, tokenizer, Path(target_dir), draft_dir, name)


__all__ = ["Pipeline", "load", "Increment", "GenerationResult", "SamplingParams"]
