"""Prompts the target writes itself (Magpie, arXiv 2406.08464), for drafter training data without a hub.

An aligned chat model fed only its template's user-turn prefix ("<|im_start|>user\n" after the default system turn)
completes it with a question of the kind it was tuned on. Sampling that prefix many times gives a prompt set in the
model's own domain; a system turn of one's own (`system`, e.g. "You are a Python programming assistant") steers it
towards a domain. `python -m dflash.data regenerate` then answers the prompts greedily.

Output rows: {"id": "PREFIX/N", "prompt": text}; a steering system turn is not kept (answers use the default one).
Resumable: rerunning appends until `num_prompts` rows exist; batch k draws with seeds seed + k * batch_size + row,
so a rerun continues the same sequence. Prompts equal (after normalising case and spaces) to an earlier one or to any
prompt of the `exclude` files (a benchmark split) are dropped, as are ones sharing a long word run with one of them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dflash.core.training.answers import input_rows
from dflash.core.training.datasets import prompt_messages, row_messages
from dflash.core.errors import DFlashError
from dflash.core.io import check_output_dir
from dflash.core.loop import generate_batch
from dflash.core.sampling import SamplingParams
from dflash.core.model_files.tokenizer import eos_token_ids, load_tokenizer

from .backend import torch_engine
from .target import load_target, resolve_device, resolve_dtype

SENTINEL = "\u2063dflash-user-turn\u2063"
SHARED_RUN = 8  # a prompt sharing this many consecutive words with an excluded one counts as a copy of it
BATCHES_PER_NEEDED = 20  # give up (one line) after this many times the batches the prompts would need at best


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """The rendered chat up to where the user's words begin: `system`'s turn, or the template's default one."""
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(turns, tokenize=False)
    if SENTINEL not in text:
        raise DFlashError("the chat template drops the user's message; cannot find its user-turn prefix")
    return text[:text.index(SENTINEL)]


def normalise(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def word_runs(text: str) -> set[tuple[str, ...]]:
    words = normalise(text).split()
    return {tuple(words[i:i + SHARED_RUN]) for i in range(len(words) - SHARED_RUN + 1)}


def excluded_prompts(paths) -> tuple[set[str], set[tuple[str, ...]]]:
    """Every user turn of the exclude files, normalised, and their word runs."""
    texts = set()
    for path in paths:
        for i, _, row in input_rows(path):
            for m in prompt_messages(row_messages(row, f"{path}:{i + 1}")):
                if m["role"] == "user":
                    texts.add(normalise(m["content"]))
    runs = set().union(*(word_runs(t) for t in texts)) if texts else set()
    return texts, runs


def write_self_prompts(model_dir, output_path, *, num_prompts: int, batch_size: int = 32, max_tokens: int = 96,
                       temperature: float = 1.0, top_p: float = 0.95, min_chars: int = 16, exclude=(),
                       system: str | None = None, id_prefix: str = "self", seed: int = 0, device: str = "auto",
                       dtype: str = "auto", trust_remote_code: bool = False, progress: bool = True,
                       log=print) -> dict:
    if num_prompts < 1:
        raise DFlashError(f"--num-prompts: got {num_prompts}, expected >= 1")
    if not 0 < temperature:
        raise DFlashError(f"--temperature: got {temperature}, expected > 0 (a greedy prefix gives one prompt)")
    output_path = Path(output_path)
    check_output_dir(output_path.parent, "--output", output_path)
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError(f"{model_dir}: the tokenizer has no chat_template; self-written prompts need one")
    prefix = tokenizer(user_turn_prefix(tokenizer, system), add_special_tokens=False)["input_ids"]
    end_of_turn = set(eos_token_ids(model_dir, tokenizer))

    seen = set()
    if output_path.exists():
        for line in output_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                seen.add(normalise(json.loads(line)["prompt"]))
    excluded, excluded_runs = excluded_prompts(exclude)
    stats = {"written": 0, "duplicate": 0, "excluded": 0, "short": 0, "unfinished": 0}
    if len(seen) >= num_prompts:
        return dict(stats, total=len(seen))

    device = resolve_device(device)
    backend = torch_engine(load_target(model_dir, resolve_dtype(dtype, device), device, trust_remote_code))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_prompts, initial=len(seen), desc="self-prompts", dynamic_ncols=True)
    done_file = output_path.with_suffix(output_path.suffix + ".batches")
    batch_index = int(done_file.read_text()) if done_file.exists() else 0
    give_up = batch_index + BATCHES_PER_NEEDED * -(-(num_prompts - len(seen)) // batch_size)
    with open(output_path, "a", encoding="utf-8") as out:
        while len(seen) < num_prompts:
            if batch_index >= give_up:
                raise DFlashError(f"{model_dir}: only {len(seen)} of {num_prompts} distinct prompts after "
                                  f"{batch_index} batches ({stats}); a chat-tuned model ends its user turns, a base "
                                  f"model rarely does (or raise --max-tokens)")
            sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed + batch_index * batch_size)
            results = generate_batch(backend, [prefix] * batch_size, max_new_tokens=max_tokens, sampling=sampling,
                                     eos_token_ids=sorted(end_of_turn))
            for r in results:
                if not (r.tokens and r.tokens[-1] in end_of_turn):
                    stats["unfinished"] += 1  # ran out of tokens mid-question
                    continue
                text = tokenizer.decode(r.tokens[:-1], skip_special_tokens=True).strip()
                key = normalise(text)
                if len(text) < min_chars:
                    stats["short"] += 1
                elif key in seen:
                    stats["duplicate"] += 1
                elif key in excluded or word_runs(text) & excluded_runs:
                    stats["excluded"] += 1
                elif len(seen) < num_prompts:
                    seen.add(key)
                    out.write(json.dumps({"id": f"{id_prefix}/{len(seen) - 1}", "prompt": text}) + "\n")
                    stats["written"] += 1
                    if bar is not None:
                        bar.update(1)
            out.flush()
            batch_index += 1
            done_file.write_text(str(batch_index))
    if bar is not None:
        bar.close()
    log(f"self-prompts: {stats['written']} written ({stats['duplicate']} duplicates, {stats['excluded']} "
        f"benchmark overlaps, {stats['short']} too short, {stats['unfinished']} unfinished dropped)")
    return dict(stats, total=len(seen))
