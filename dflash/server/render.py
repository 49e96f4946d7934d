"""OpenAI's response objects and stream chunks, from a generation's increments and result."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..core.loop import GenerationResult, Increment
from .parsing import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generation_tokens,
            "total_tokens": result.prompt_tokens + result.generation_tokens}


def dflash_stats(result: GenerationResult, reused: int, max_tokens: int, capped: bool) -> dict:
    """What the speculative loop did for this request."""
    b = result.block_size
    histogram = [0] * b
    for n in result.acceptance_lengths:
        histogram[min(n, b) - 1] += 1
    cycles = len(result.acceptance_lengths)
    return {"tau": round(result.mean_acceptance_length, 4), "cycles": cycles,
            "verified_tokens": sum(result.verified), "accepted_tokens": sum(n - 1 for n in result.acceptance_lengths),
            "acceptance_histogram": histogram, "verify_mode": result.verify_mode, "block_size": b,
            "accept_rule": result.accept_rule,
            "prompt_tokens_reused": reused, "prefill_seconds": round(result.prefill_seconds, 6),
            "decode_seconds": round(result.decode_seconds, 6), "max_tokens": max_tokens,
            "max_tokens_capped": capped}


def finish_reason(result: GenerationResult, tool_calls: bool) -> str:
    return "tool_calls" if tool_calls and result.finish_reason == "stop" else result.finish_reason


class Logprobs:
    """Collects the increments' log-probabilities in OpenAI's chat or completions shape."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.entries: list[dict] = []
        self.offset = 0

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def add(self, inc: Increment) -> list[dict]:
        """Entries for the tokens whose text `inc` releases; a chosen token is spelled as the text it added to the
        output (so the entries join to the returned text), an alternative as the tokenizer spells it."""
        new = []
        for text, lp, top in zip(inc.token_texts or [], inc.logprobs or [], inc.top_logprobs or []):
            new.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": self._text(i), "logprob": v, "bytes": list(self._text(i).encode())}
                                         for i, v in top]})
        self.entries.extend(new)
        return new

    def chat_object(self, entries: list[dict]) -> dict:
        return {"content": entries}

    def completion_object(self, entries: list[dict]) -> dict:
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def render(self, entries: list[dict]) -> dict:
        return self.chat_object(entries) if self.chat else self.completion_object(entries)


def chat_delta(delta: Delta) -> dict:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = delta.tool_calls
    return out


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, logprobs=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, logprobs=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_response(rid: str, model: str, total: Delta, result: GenerationResult, logprobs, stats: dict) -> dict:
    message: dict[str, Any] = {"role": "assistant",
                               "content": total.content if total.content or not total.tool_calls else None}
    if total.reasoning:
        message["reasoning_content"] = total.reasoning
    if total.tool_calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in total.tool_calls]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": finish_reason(result, bool(total.tool_calls))}],
            "usage": usage(result), "dflash": stats}


def completion_response(rid: str, model: str, text: str, result: GenerationResult, logprobs, stats: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}],
            "usage": usage(result), "dflash": stats}
