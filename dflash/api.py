"""The Python API:

    import dflash
    pipe = dflash.load("Qwen/Qwen3-8B")                  # drafter from the registry; no args = bundled pair
    print(pipe.generate("Write a haiku", chat=True).text)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

from . import hub
from .errors import DFlashError
from .loop import Generation, GenerationResult, Increment, generate_batch
from .sampling import SamplingParams


class Pipeline:
    """A target, an optional drafter and the target's tokenizer, behind one backend."""

    def __init__(self, backend, tokenizer, target_dir: Path, draft_dir: Path | None, backend_name: str):
        self.backend, self.tokenizer = backend, tokenizer
        self.target_dir, self.draft_dir, self.backend_name = target_dir, draft_dir, backend_name
        self.eos_token_ids = eos_token_ids(target_dir, tokenizer)
        self._batched = None

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
        sampling = sampling or SamplingParams(**sampling_kwargs)
        ids = self.encode(prompt, chat=chat)
        max_new_tokens = self.fit_to_context(max_new_tokens, len(ids))
        return Generation(self.backend, ids, tokenizer=self.tokenizer, max_new_tokens=max_new_tokens,
                          sampling=sampling, eos_token_ids=self.eos_token_ids, stop_strings=stop, trace=trace)

    def fit_to_context(self, max_new_tokens: int, prompt_tokens: int) -> int:
        """max_new_tokens, capped with one line on stderr so that prompt + generation stay within the target's
        context (past max_position_embeddings a model's output is untrained territory, not an error)."""
        max_context = getattr(self.backend, "max_context", None)
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
        each row accepting its own prefix; greedy row i equals generate(prompts[i])."""
        if self.backend_name != "torch":
            raise DFlashError(f"--batch-size: batched decoding runs on the torch backend, not {self.backend_name}; "
                              "use --backend torch or --batch-size 1")
        if self._batched is None:
            from dflash.backends.torch.batched import BatchedTorchBackend

            self._batched = BatchedTorchBackend.from_backend(self.backend)
        sampling = sampling or SamplingParams(**sampling_kwargs)
        return generate_batch(self._batched, [self.encode(p, chat=chat) for p in prompts], tokenizer=self.tokenizer,
                              max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=self.eos_token_ids,
                              stop_strings=stop, trace=trace)


def load(model: str | os.PathLike | None = None, draft: str | os.PathLike | None = None, *, backend: str = "auto",
         no_draft: bool = False, dtype: str = "auto", device: str = "auto", block_size: int | None = None,
         draft_window: int | None = None, trust_remote_code: bool = False) -> Pipeline:
    from dflash import backends

    from dflash.converters.checkpoint import check_target_dir

    from .spec import DraftSpec

    name = backends.pick(backend)  # cheap checks first: a bad flag or config costs no model load
    if model is None:
        from .reference import reference_dirs

        target_dir, default_draft = reference_dirs()
        draft = draft if draft is not None else default_draft
    else:
        pair = hub.pair_for(str(model))  # refuse a known-unsupported family before downloading it
        if pair is not None and not no_draft and backends.pick(backend) not in pair.backends:
            raise DFlashError(f"--model: {pair.target} is not supported by the {backends.pick(backend)} backend "
                              f"for speculative decoding ({pair.note or 'see python -m dflash.models'}); "
                              "--no-draft runs it without a drafter")
        target_dir = hub.resolve(model, "--model")
        if draft is None and not no_draft:
            draft = hub.draft_for(str(model))
            if draft is None:
                raise DFlashError(f"--draft: no known DFlash drafter for {model}; pass --draft DIR_OR_ID "
                                  "(or --no-draft for plain decoding)")
    draft_dir = None if no_draft else hub.resolve(draft, "--draft")
    check_target_dir(target_dir)  # config.json and safetensors headers, before any framework reads them
    if draft_dir is not None:
        DraftSpec.load(draft_dir)  # the drafter's config.json, before any framework is imported
    package = backends.get(name)  # one line if its library is missing
    if name == "mlx":
        from . import blas

        blas.tell_once(blas.advice(blas.mlx_blas()))  # the inputs are fine: say why this run will be slow
    tokenizer = load_tokenizer(target_dir, trust_remote_code)
    be = package.load(target_dir, draft_dir, dtype=dtype, device=device, block_size=block_size,
                      draft_window=draft_window, trust_remote_code=trust_remote_code)
    if len(tokenizer) > be.info.vocab_size:
        raise DFlashError(f"{target_dir}: the tokenizer has {len(tokenizer)} tokens but the target's embedding table "
                          f"has {be.info.vocab_size} rows (a tokenizer of another model?)")
    return Pipeline(be, tokenizer, Path(target_dir), draft_dir, name)


def load_tokenizer(target_dir, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                           "tokenizer.model", "vocab.json")):
        raise DFlashError(f"{target_dir}: no tokenizer files (expected tokenizer.json or tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"{target_dir}: cannot load the tokenizer ({first})") from None


def eos_token_ids(target_dir, tokenizer) -> set[int]:
    """Every EOS id the tokenizer, config.json and generation_config.json name."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        path = Path(target_dir) / name
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                continue
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids


def chat_ids(tokenizer, messages: list[dict], system: str | None = None, enable_thinking: bool | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("--chat: this tokenizer has no chat template; drop --chat for plain completion")
    if system:
        messages = [{"role": "system", "content": system}] + list(messages)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


__all__ = ["Pipeline", "load", "Increment", "GenerationResult", "SamplingParams"]
