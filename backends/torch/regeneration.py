"""Answer training prompts with the target itself (the paper's "regenerated responses"), resumably.

Output rows: {"id", "messages": [prompt turns..., {"role": "assistant", "content": answer}], "thinking", "status",
"finish_reason", "prompt_tokens", "answer_tokens"}. Every input row gets exactly one output row, with status "ok",
"failed" (generation raised; "error" says why) or "skipped" (no prompt, or the prompt does not fit the context).

Crash safety: each row is appended, flushed and fsynced as soon as its answer is done (rows of a batch finish at
their own EOS), and the output file is created with its first row, never empty. On restart the ids already in the
output are skipped and a torn last line (the process died mid-write) is cut off, so rerunning the same command
after a SIGKILL or Ctrl-C at any point loses no finished row and duplicates none.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

from dflash.core.training.answers import AnswerFile, input_rows, recover_output, write_stats
from dflash.core.training.datasets import prompt_messages, row_messages
from dflash.core.errors import DFlashError
from dflash.core.io import check_output_dir
from dflash.core.loop import generate_batch
from dflash.core.sampling import SamplingParams
from dflash.core.spec import DraftSpec
from dflash.core.model_files.tokenizer import eos_token_ids, load_tokenizer

from .backend import torch_engine
from .drafter import load_drafter
from .target import load_target, resolve_device, resolve_dtype, target_info


def regenerate(model_dir, input_path, output_path, *, batch_size: int = 8, temperature: float = 0.0,
               top_p: float = 1.0, max_new_tokens: int = 512, enable_thinking: bool | None = None,
               max_prompt_tokens: int | None = None, device: str = "auto", dtype: str = "auto", seed: int = 0,
               trust_remote_code: bool = False, progress: bool = True, draft=None, log=print) -> dict:
    """Answer every prompt of `input_path` with the target, appending to `output_path`; returns the stats.

    Batches go through batched speculative decoding (dflash.core.loop.generate_batch): with a DFlash `draft` the answers
    come faster and are still the target's own (greedy: identical; sampled: the target's distribution)."""
    if batch_size < 1:
        raise DFlashError(f"--batch-size: got {batch_size}, expected >= 1")
    if max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens: got {max_new_tokens}, expected >= 1")
    if not temperature >= 0 or math.isinf(temperature):  # NaN fails every comparison
        raise DFlashError(f"--temperature: got {temperature}, expected a finite number >= 0")
    if not 0 < top_p <= 1:
        raise DFlashError(f"--top-p: got {top_p}, expected 0 < top_p <= 1")
    output_path = Path(output_path)
    if output_path.is_dir():
        raise DFlashError(f"--output: {output_path} is a directory, expected a JSONL file")
    check_output_dir(output_path.parent, "--output", output_path)  # created only once the inputs are validated
    done = recover_output(output_path)

    rows = input_rows(input_path)
    todo = [(i, rid, row) for i, rid, row in rows if rid not in done]
    log(f"regenerate: {len(rows)} input rows, {len(rows) - len(todo)} already done, {len(todo)} to answer")

    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError(f"{model_dir}: the tokenizer has no chat_template; regenerate needs the target's template")
    device = resolve_device(device)
    model = load_target(model_dir, resolve_dtype(dtype, device), device, trust_remote_code) if todo else None
    backend = _batched_backend(model, draft) if todo else None
    eos = sorted(eos_token_ids(model_dir, tokenizer))
    limit = max_prompt_tokens
    if limit is None and model is not None:
        ctx = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        limit = ctx - max_new_tokens if ctx else None
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    bar = None
    if progress and todo:
        from tqdm import tqdm

        # per answer, with the tokens decoded so far: a batch of long answers takes minutes before its first ends
        bar = tqdm(total=len(todo), desc="regenerate", unit="answer", dynamic_ncols=True)
    output = AnswerFile(output_path)
    tokens = 0

    def emit(row: dict) -> None:
        output.append(row)
        if bar is not None:
            bar.update(1)

    def decoded(n: int) -> None:
        nonlocal tokens
        tokens += n
        if bar is not None:
            bar.set_postfix_str(f"{tokens} tokens", refresh=False)
            bar.update(0)  # redraws at tqdm's own pace (mininterval)

    try:
        batch = []
        for i, rid, row in todo:
            base = {"id": rid, "thinking": bool(enable_thinking), "status": "skipped"}
            try:
                messages = prompt_messages(row_messages(row, f"{input_path}:{i + 1}"))
            except DFlashError as e:
                emit(dict(base, error=str(e)))
                continue
            if not messages or messages[-1]["role"] not in ("user", "tool"):
                emit(dict(base, error="no user turn to answer"))
                continue
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if limit is not None and len(ids) > limit:
                emit(dict(base, error=f"prompt has {len(ids)} tokens, more than {limit} fit"))
                continue
            batch.append((rid, messages, ids))
            if len(batch) == batch_size:
                _answer(backend, tokenizer, batch, eos, max_new_tokens, temperature, top_p, seed, enable_thinking,
                        emit, decoded)
                batch = []
        if batch:
            _answer(backend, tokenizer, batch, eos, max_new_tokens, temperature, top_p, seed, enable_thinking, emit,
                    decoded)
    finally:
        output.close()
        if bar is not None:
            bar.close()
    output.ensure()
    return write_stats(output_path, len(rows), log)


def _batched_backend(model, draft_dir):
    """The engine over the loaded target, with the drafter (validated and hooked by torch_engine) if any."""
    drafter = None
    if draft_dir is not None:
        spec = DraftSpec.load(draft_dir)
        spec.validate_against(target_info(model), source=str(draft_dir))  # before its weights are read
        drafter = load_drafter(draft_dir, dtype=model.dtype, device=model.device, spec=spec)
    backend = torch_engine(model, drafter, validated=True)
    if not backend.capabilities.batches:  # one line now, not one failed row per batch
        raise DFlashError(backend.capabilities.batch_refusal)
    return backend


def _answer(backend, tokenizer, batch, eos, max_new_tokens, temperature, top_p, seed, enable_thinking, emit,
            decoded) -> None:
    """Answer a batch through the speculative loop, emitting each row the moment its answer ends. If the batch
    raises, the rows not yet emitted are answered one by one: the row that fails gets a "failed" row, the others
    their answers."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p,
                              seed=seed + zlib.crc32(batch[0][0].encode()) if temperature > 0 else None)
    emitted = set()

    def on_cycle(tokens: int, finished: list) -> None:
        decoded(tokens)
        for k, result in finished:
            emit(_answer_row(batch[k], result, tokenizer, eos, enable_thinking))
            emitted.add(k)

    try:
        generate_batch(backend, [ids for _, _, ids in batch], max_new_tokens=max_new_tokens, sampling=sampling,
                       eos_token_ids=eos, on_cycle=on_cycle)
    except (RuntimeError, ValueError, DFlashError) as e:
        rest = [item for k, item in enumerate(batch) if k not in emitted]
        if len(batch) > 1:  # find the row that fails; the others still get answered
            for item in rest:
                _answer(backend, tokenizer, [item], eos, max_new_tokens, temperature, top_p, seed, enable_thinking,
                        emit, decoded)
            return
        emit({"id": batch[0][0], "thinking": bool(enable_thinking), "status": "failed",
              "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})


def _answer_row(item, result, tokenizer, eos, enable_thinking) -> dict:
    """The output row of one finished answer (EOS cut off)."""
    rid, messages, ids = item
    ended = result.finish_reason == "stop" and result.tokens and result.tokens[-1] in eos
    tokens = result.tokens[:-1] if ended else result.tokens
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    thinking = bool(enable_thinking) if enable_thinking is not None else "<think>" in text
    return {"id": rid, "messages": messages + [{"role": "assistant", "content": text}], "thinking": thinking,
            "status": "ok", "finish_reason": "stop" if ended else "length", "prompt_tokens": len(ids),
            "answer_tokens": len(tokens)}
