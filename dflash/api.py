"""The Python API:

    import dflash
    pipe = dflash.load("Qwen/Qwen3-8B")                  # drafter from the registry; no args = bundled pair
    print(pipe.generate("Write a haiku", chat=True).text)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

from . import hub
from .errors import DFlashError
from .loop import Generation, GenerationResult, Increment, generate_batch
from .sampling import SamplingParams
from .tokenizer import chat_ids, eos_token_ids, load_tokenizer  # noqa: F401  (re-exported)


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
        return Generation(self.backend, self.encode(prompt, chat=chat), tokenizer=self.tokenizer,
                          max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=self.eos_token_ids,
                          stop_strings=stop, trace=trace)

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
    tokenizer = load_tokenizer(target_dir, trust_remote_code)
    be = package.load(target_dir, draft_dir, dtype=dtype, device=device, block_size=block_size,
                      draft_window=draft_window, trust_remote_code=trust_remote_code)
    if len(tokenizer) > be.info.vocab_size:
        raise DFlashError(f"{target_dir}: the tokenizer has {len(tokenizer)} tokens but the target's embedding table "
                          f"has {be.info.vocab_size} rows (a tokenizer of another model?)")
    return Pipeline(be, tokenizer, Path(target_dir), draft_dir, name)


__all__ = ["Pipeline", "load", "Increment", "GenerationResult", "SamplingParams"]
