"""OpenAI's request bodies (the fields dflash serves, those it refuses) and error objects.

Every field a request may carry is named here, once: a field of the models below is honoured (or, like `user`,
accepted because it changes nothing in the output), a field of NOT_SERVED is refused by name unless its value asks
for nothing dflash lacks, and any other field is refused as unknown (as OpenAI refuses one). tests/test_server_protocol.py
holds this list against the installed openai package's request types, so a field OpenAI adds cannot slip through.
Types are strict: a string temperature is refused, not coerced.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


# field -> (the values that ask for nothing dflash lacks, besides null; why any other value is refused)
NOT_SERVED: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "only 1 is supported (send n requests instead)"),
    "best_of": ((1,), "only 1 is supported (send several requests and compare them yourself)"),
    "echo": ((False,), "not supported (the prompt is not returned)"),
    "suffix": ((), "not supported (no fill-in-the-middle)"),
    "response_format": (({"type": "text"},), 'only {"type": "text"} is supported (no JSON mode or schemas)'),
    "functions": ((), 'the legacy functions API is not supported; send "tools"'),
    "function_call": ((), 'the legacy functions API is not supported; send "tool_choice"'),
    "parallel_tool_calls": ((True,), "only true is supported (every tool call the model writes is returned)"),
    "modalities": ((["text"],), 'only ["text"] is supported'),
    "audio": ((), "not supported (text output only)"),
    "prediction": ((), "not supported (no predicted outputs)"),
    "reasoning_effort": ((), "not supported; a thinking model's template may take chat_template_kwargs "
                             '(e.g. {"enable_thinking": false})'),
    "verbosity": ((), "not supported"),
    "service_tier": (("auto", "default"), 'only "auto" or "default" (this server has one tier)'),
    "web_search_options": ((), "not supported (no web search)"),
    "store": ((False,), "not supported (completions are not stored)"),
    "moderation": ((), "not supported (no moderation)"),
    "prompt_cache_retention": ((), "not supported (the prefix cache keeps what fits, for as long as it fits)"),
    "prompt_cache_options": ((), "not supported (the prefix cache keeps what fits, for as long as it fits)"),
}
CHAT_NOT_SERVED = ("n", "response_format", "functions", "function_call", "parallel_tool_calls", "modalities",
                   "audio", "prediction", "reasoning_effort", "verbosity", "service_tier", "web_search_options",
                   "store", "moderation", "prompt_cache_retention", "prompt_cache_options")
COMPLETION_NOT_SERVED = ("n", "best_of", "echo", "suffix", "response_format")
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 1000  # a stop string is a marker; each cycle searches the new text for every one


def _asks_nothing(value, allowed: tuple) -> bool:
    # (by type too: true == 1 in Python, but "n": true is no count)
    return value is None or any(type(value) is type(ok) and value == ok for ok in allowed)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Sampled(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    not_served: ClassVar[tuple[str, ...]] = ()

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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # (accepted: it labels the request and changes nothing in its output)

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_served(cls, body):
        """A field dflash does not implement is refused by name (never ignored) unless it asks for nothing, and
        leaves the body once it is decided."""
        if not isinstance(body, dict):
            return body
        for name in cls.not_served:
            allowed, why = NOT_SERVED[name]
            if name in body and not _asks_nothing(body[name], allowed):
                raise ApiError(400, f"{name}: got {json.dumps(body[name])[:60]}, {why}", name)
        return {k: v for k, v in body.items() if k not in cls.not_served}

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, 'stream_options: only allowed with "stream": true', "stream_options")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop: got {len(stops)} stop strings, expected at most {MAX_STOP_STRINGS}", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            longest = max(len(s) for s in stops)
            raise ApiError(400, f"stop: a stop string of {longest} characters, expected at most {MAX_STOP_CHARS}",
                           "stop")
        return self

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


class Function(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: Function

    def for_template(self) -> dict:
        return self.model_dump(exclude_none=True)


class ChatRequest(_Sampled):
    not_served: ClassVar[tuple[str, ...]] = CHAT_NOT_SERVED

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1)  # served where the template renders them
    tool_choice: Union[str, dict[str, Any], None] = None  # "none" / "auto" (dflash.server.tools)
    chat_template_kwargs: dict[str, Any] | None = None
    # (accepted: they label the request or hint at caching, and change nothing in its output)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, 'top_logprobs: needs "logprobs": true', "top_logprobs")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampled):
    not_served: ClassVar[tuple[str, ...]] = COMPLETION_NOT_SERVED

    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = None

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
