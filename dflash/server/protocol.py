"""OpenAI's request bodies (the fields dflash serves) and error objects.

Types are strict (a string temperature is refused, not coerced); unknown fields are ignored, as OpenAI-compatible
servers do, so clients that send `user` or `metadata` still work.
"""

from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from ..core.sampling import AcceptRule, SamplingParams


class ApiError(Exception):
    """A request the server refuses: becomes OpenAI's error object with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Sampled(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    stop: Union[str, list[str], None] = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids (as strings) -> bias
    seed: int | None = None
    accept: AcceptRule = "auto"  # the acceptance rule when sampling (dflash.core.sampling)
    draft_temperature: float = 0.5  # accept "sharpened": the drafts come from q^(1/t)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: Any = None  # refused unless {"type": "text"} (dflash.server.intake)

    def sampling(self, defaults: dict | None = None) -> SamplingParams:
        """The request's settings; a field it does not set takes `defaults` (the model's generation_config), then
        OpenAI's (temperature 1, everything else off)."""
        values = {**OPENAI_DEFAULTS, **(defaults or {})}
        values.update({k: getattr(self, k) for k in OPENAI_DEFAULTS if getattr(self, k) is not None})
        return SamplingParams(**values, presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0, logit_bias=self.bias_pairs(),
                              seed=self.seed, accept=self.accept,
                              draft_temperature=self.draft_temperature)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs: OpenAI's keys are token ids written as strings."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ApiError(400, f"logit_bias: key {key[:20]!r} is not a token id (expected ids as strings, "
                               "e.g. {\"50256\": -100})", "logit_bias")
            pairs.append((int(key), value))
        return tuple(pairs)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampled):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampled):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def token_limit(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's completions default

    def logprobs_k(self) -> int | None:
        return self.logprobs


MAX_TOP_LOGPROBS = 20


def message_text(content) -> str:
    """A message's content as text: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" for p in content):
            raise ApiError(400, "messages: only text content parts are supported", "messages")
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, "messages: content must be a string or a list of text parts", "messages")


def chat_messages(messages: list[dict]) -> list[dict]:
    """The messages as a chat template reads them (text content; tool calls' arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role: got {role!r}, expected system, user, assistant or tool",
                           f"messages[{i}].role")
        msg = dict(m, role="system" if role == "developer" else role, content=message_text(m.get("content")))
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls: expected a list of tool calls",
                               f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _template_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
            not isinstance(fn.get("arguments", "{}"), (str, dict)):
        raise ApiError(400, f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\": str, "
                       f"\"arguments\": str}}}} (got {json.dumps(call)[:60]})", where)
    fn = dict(fn)
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return dict(call, function=fn)
