"""python -m dflash.bench answers: how fast the target writes training answers, our lanes against transformers'
`generate()`.

    python -m dflash.bench answers --model smollm2 --lanes 128 --rounds 2 --out runs/answers_bench.json

`generate()` answers a batch of `--lanes` requests (the bundled training split's, through the chat template, left
padded) greedily with up to `--max-answer-tokens` each, with its default dynamic cache and with its static cache;
a row's tokens count up to its end of turn. The lanes (`python -m dflash.data answers`) run as long as that call
took, writing their own requests and answering them; only answer tokens count, so the requests they write are
their overhead. The methods alternate round by round in one process; the first round of each is a warm-up (the
lanes' window grows to its working size there). Each round also times the target's forward over 16 whole answers the
lanes wrote (batches of 8): what training on stored answers pays again per token to read the target's features.
One thread; prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from .. import cli, hub
from ..core.io import atomic_write_text
from ..core.model_files.tokenizer import eos_token_ids, load_tokenizer
from .prompts import chat_ids, prompt_rows

TRAIN_PROMPTS = Path(__file__).parent / "prompts" / "chat_train.jsonl"


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.bench answers", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an aligned chat target: local HF directory or hub id")
    p.add_argument("--lanes", type=int, default=128, help="batch: lanes, and generate()'s rows (default: %(default)s)")
    p.add_argument("--max-answer-tokens", type=int, default=320)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per method after the warm-up")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU multiplies it in hardware")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="also write the JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    from dflash.backends.torch.answer_lanes import SYSTEMS, AnswerLanes, Settings, batch_dtype
    from dflash.backends.torch.target import load_target

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = hub.resolve(args.model, "--model")
    tokenizer = load_tokenizer(model_dir)
    dtype = batch_dtype(args.dtype, "cpu")
    model = load_target(model_dir, dtype, "cpu")
    end = sorted(eos_token_ids(model_dir, tokenizer))
    rows = [chat_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
            for row in prompt_rows(str(TRAIN_PROMPTS), False)]
    rows = (rows * -(-args.lanes // len(rows)))[:args.lanes]
    width = max(map(len, rows))  # left padded, as generate() wants a batch
    ids = torch.tensor([[end[0]] * (width - len(r)) + r for r in rows])
    batch = {"input_ids": ids, "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])}
    lanes = AnswerLanes(model, tokenizer, [s for s, _ in SYSTEMS], [w for _, w in SYSTEMS], set(end),
                        lambda text: None, lanes=args.lanes, settings=Settings(max_answer_tokens=args.max_answer_tokens))

    def generate(cache: str | None) -> tuple[int, float]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=False, max_new_tokens=args.max_answer_tokens, eos_token_id=end,
                                 pad_token_id=end[0], cache_implementation=cache)
        seconds = time.perf_counter() - start
        new = out[:, batch["input_ids"].shape[1]:].tolist()
        return sum(next((i + 1 for i, t in enumerate(row) if t in end), len(row)) for row in new), seconds

    written = []

    def run_lanes(seconds: float) -> tuple[int, float]:
        start, tokens = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            rows = lanes.step()
            written.extend(rows)
            tokens += sum(len(r.ids) - r.answer_start for r in rows)
        return tokens, time.perf_counter() - start

    def forward_answers() -> tuple[int, float]:
        tokens, start = 0, time.perf_counter()
        for i in range(0, 16, 8):
            rows = [r.ids for r in written[-16:][i:i + 8]]
            width = max(map(len, rows))
            ids = torch.tensor([r + [end[0]] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
            tokens += int(mask.sum())
        return tokens, time.perf_counter() - start

    rates: dict[str, list[float]] = {"generate": [], "generate_static": [], "lanes": [], "forward": []}
    for r in range(args.rounds + 1):
        for name, cache in (("generate", None), ("generate_static", "static")):
            tokens, seconds = generate(cache)
            if r:
                rates[name].append(tokens / seconds)
            tokens, seconds = run_lanes(seconds)
            if r:
                rates["lanes"].append(tokens / seconds)
        if r and len(written) >= 16:
            tokens, seconds = forward_answers()
            rates["forward"].append(tokens / seconds)
        measured = ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items() if v and r)
        print(f"round {r}: {measured or 'warm-up'} tokens/s", file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in rates.items() if v}
    result = {"model": str(args.model), "dtype": str(dtype).removeprefix("torch."), "lanes": args.lanes,
              "max_answer_tokens": args.max_answer_tokens, "tokens_per_s": medians,
              "lanes_vs_generate": round(medians["lanes"] / medians["generate"], 2),
              "lanes_vs_generate_static": round(medians["lanes"] / medians["generate_static"], 2), "rounds": rates}
    print(json.dumps(result))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0
