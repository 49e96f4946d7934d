"""Answer training prompts with the target itself (the paper's "regenerated responses"), resumably.

Output rows: {"id", "messages": [prompt turns..., {"role": "assistant", "content": answer}], "thinking", "status",
"finish_reason", "prompt_tokens", "answer_tokens"}. Every input row gets exactly one output row, with status "ok",
"failed" (generation raised; "error" says why) or "skipped" (no prompt, or the prompt does not fit the context).

Crash safety: each row is appended, flushed and fsynced as soon as its batch is done. On restart the ids already in
the output are skipped and a torn last line (the process died mid-write) is cut off, so rerunning the same command
after a SIGKILL at any point loses no finished row and duplicates none.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

from dflash.core.answers import append_row as _append, input_rows, recover_output, write_stats
from dflash.core.datasets import prompt_messages, row_messages
from dflash.core.errors import DFlashError
from dflash.core.io import check_output_dir
from dflash.core.loop import generate_batch
from dflash.core.sampling import SamplingParams
from dflash.core.spec import DraftSpec
from dflash.core.tokenizer import eos_token_ids, load_tokenizer

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

        bar = tqdm(total=len(todo), desc="regenerate", dynamic_ncols=True)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out:
        batch = []

        def run_batch():
            rows_out = _answer(backend, tokenizer, batch, eos, max_new_tokens, temperature, top_p, seed,
                               enable_thinking)
            for r in rows_out:
                _append(out, r)
            if bar is not None:
                bar.update(len(batch))
            batch.clear()

        for i, rid, row in todo:
            base = {"id": rid, "thinking": bool(enable_thinking), "status": "skipped"}
            try:
                messages = prompt_messages(row_messages(row, f"{input_path}:{i + 1}"))
            except DFlashError as e:
                _append(out, dict(base, error=str(e)))
                continue
            if not messages or messages[-1]["role"] not in ("user", "tool"):
                _append(out, dict(base, error="no user turn to answer"))
                continue
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if limit is not None and len(ids) > limit:
                _append(out, dict(base, error=f"prompt has {len(ids)} tokens, more than {limit} fit"))
                continue
            batch.append((rid, messages, ids))
            if len(batch) == batch_size:
                run_batch()
        if batch:
            run_batch()
    if bar is not None:
        bar.close()
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


def _generate(backend, prompts: list[list[int]], eos, max_new_tokens, temperature, top_p, seed):
    """One batch through the speculative loop; returns each prompt's new tokens (EOS cut) and finish reason."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed if temperature > 0 else None)
    results = generate_batch(backend, prompts, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos)
    answers = []
    for r in results:
        ended = r.finish_reason == "stop" and r.tokens and r.tokens[-1] in eos
        answers.append((r.tokens[:-1] if ended else r.tokens, "stop" if ended else "length", r.acceptance_lengths))
    return answers


def _answer(backend, tokenizer, batch, eos, max_new_tokens, temperature, top_p, seed, enable_thinking):
    try:
        answers = _generate(backend, [ids for _, _, ids in batch], eos, max_new_tokens, temperature, top_p,
                            seed + zlib.crc32(batch[0][0].encode()))
    except (RuntimeError, ValueError, DFlashError) as e:
        if len(batch) > 1:  # find the row that fails; the others still get answered
            return [r for item in batch for r in _answer(backend, tokenizer, [item], eos, max_new_tokens,
                                                         temperature, top_p, seed, enable_thinking)]
        rid = batch[0][0]
        return [{"id": rid, "thinking": bool(enable_thinking), "status": "failed",
                 "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}]
    rows = []
    for (rid, messages, ids), (tokens, finish, cycles) in zip(batch, answers):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        thinking = bool(enable_thinking) if enable_thinking is not None else "<think>" in text
        rows.append({"id": rid, "messages": messages + [{"role": "assistant", "content": text}],
                     "thinking": thinking, "status": "ok", "finish_reason": finish, "prompt_tokens": len(ids),
                     "answer_tokens": len(tokens)})
    return rows
