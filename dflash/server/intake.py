"""A request body -> the Generation the engine thread runs: field checks, sampling defaults, the chat template and
tokenising. Runs off the event loop (Server.generate: a worker thread, with a time bound), so a slow template or a
long prompt never stalls /health or the other streams."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from pydantic import ValidationError

from ..core.admission import check_fits
from ..core.errors import DFlashError, SettingError
from ..core.loop import Generation
from ..core.sampling import SamplingParams
from . import render, tools
from .parsing import THINK_CLOSE, THINK_OPEN, OutputParser, starts_in_reasoning
from .protocol import MAX_TOP_LOGPROBS, ApiError, ChatRequest, CompletionRequest, chat_messages

# what a request may not set through chat_template_kwargs: the template itself (templates come from the model or
# the operator's --chat-template, never from a client: a template is code, and a hostile one stalls the server) and
# the arguments the server sets
RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "add_generation_prompt", "tools", "conversation",
                            "return_dict", "return_tensors", "continue_final_message")
# a rendered prompt longer than this many characters per context token cannot fit (tokens average ~4 characters)
CHARS_PER_TOKEN_BOUND = 16
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class RequestState:
    """One request's state besides its Generation, from intake to its last byte."""

    chat: bool
    id: str
    parser: OutputParser  # the output's reasoning / content / tool-call split (chat)
    max_tokens: int  # as served
    capped: bool  # max_tokens was capped to what the context has left
    access: dict  # the fields of its access log line

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def model_sampling_defaults(target_dir) -> dict:
    """The sampling fields of the target's generation_config.json (vLLM's --generation-config auto: only the
    fields it names; the others keep OpenAI's defaults). {} when there is no such file."""
    path = Path(target_dir) / "generation_config.json" if target_dir else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None
    out = {k: config[k] for k in SAMPLING_FIELDS if isinstance(config.get(k), (int, float))}
    try:
        SamplingParams(**out).validate()
    except DFlashError as e:
        raise DFlashError(f"{path}: {e} (pass --default-sampling openai to ignore it)") from None
    return out


def parse_body(raw: bytes, chat: bool):
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate_json(raw)
    except ValidationError as e:
        raise _field_error(e) from None


def _field_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"body: not valid JSON ({err['msg']})", None, "invalid_json")
    loc = _location(err["loc"])
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"{loc}: unknown field (not one this endpoint serves)", loc, "unknown_field")
    got = err.get("input")
    shown = "" if err["type"] == "missing" else f" (got {str(got)[:60]!r})"
    return ApiError(400, f"{loc}: {err['msg']}{shown}", loc, "invalid_type" if "type" in err["type"] else None)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _location(loc) -> str:
    """A field path as a client spells it (messages[0].role), without pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not ("[" in part or "-" in part or part in _TYPE_TAGS):
            out += f".{part}" if out else part
    return out or "body"


class Intake:
    def __init__(self, pipe, names: set[str], model_name: str, chat_template: str | None = None,
                 sampling_defaults: dict | None = None):
        self.pipe, self.engine, self.tokenizer = pipe, pipe.engine, pipe.tokenizer
        self.names, self.model_name = names, model_name
        self.chat_template, self.sampling_defaults = chat_template, dict(sampling_defaults or {})
        vocab = self.tokenizer.get_vocab()
        self.reasoning = THINK_OPEN in vocab and THINK_CLOSE in vocab

    def prepare(self, req, chat: bool) -> tuple[Generation, "RequestState"]:
        if req.model is not None and req.model not in self.names:
            raise ApiError(404, f"model: {req.model!r} is not served here (serving {self.model_name!r})", "model",
                           "model_not_found")
        try:
            sampling = req.sampling(self.sampling_defaults).validate(self.engine.info.vocab_size)
        except SettingError as e:  # named by the field the client sent (top_p), not the CLI's flag
            raise ApiError(400, f"{e.field}: {e.message}", e.field) from None
        if req.seed is not None and req.seed >= 2**63:
            raise ApiError(400, f"seed: got {req.seed}, expected 0 .. 2**63 - 1", "seed")
        k = req.logprobs_k()
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            field = "top_logprobs" if chat else "logprobs"
            raise ApiError(400, f"{field}: got {k}, expected 0 .. {MAX_TOP_LOGPROBS}", field)
        in_reasoning, uses_tools = False, False
        if chat:
            uses_tools = tools.wanted(req)
            ids, prompt_text = self.chat_prompt(req, uses_tools)
            in_reasoning = self.reasoning and starts_in_reasoning(prompt_text)
        else:
            ids = self.completion_prompt(req)
        try:
            check_fits(ids, self.engine.max_context)
        except DFlashError as e:
            raise ApiError(400, f"messages: {e}" if chat else str(e), "messages" if chat else "prompt",
                           "context_length_exceeded") from None
        limit, capped = self.token_limit(req, len(ids))
        stops = req.stop_strings()
        gen = Generation(self.engine, ids, tokenizer=self.tokenizer, max_new_tokens=limit, sampling=sampling,
                         eos_token_ids=self.pipe.eos_token_ids, stop_strings=stops, logprobs=k)
        parser = OutputParser(reasoning=self.reasoning and chat, in_reasoning=in_reasoning,
                              tools=uses_tools)
        rid = render.new_id("chatcmpl" if chat else "cmpl")
        access = {"id": rid, "prompt_tokens": len(ids), "max_tokens": limit}
        return gen, RequestState(chat, rid, parser, limit, capped, access)

    def chat_prompt(self, req: ChatRequest, uses_tools: bool) -> tuple[list[int], str]:
        tok = self.tokenizer
        if not (self.chat_template or getattr(tok, "chat_template", None)):
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions (or start the "
                           "server with --chat-template)", "messages")
        messages = chat_messages(req.messages)
        kwargs = dict(req.chat_template_kwargs or {})
        for key in RESERVED_TEMPLATE_KWARGS:
            if key in kwargs:
                why = ("templates come from the model or the server's --chat-template" if key == "chat_template"
                       else "the server sets it" if key != "tools" else "send the top-level \"tools\" field")
                raise ApiError(400, f"chat_template_kwargs.{key}: not accepted ({why})",
                               f"chat_template_kwargs.{key}")
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template

        def render_with(tool_list: list | None) -> str:
            try:
                return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               **kwargs, **({"tools": tool_list} if tool_list else {}))
            except Exception as e:  # jinja2 errors and bad message shapes: the client's input
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ApiError(400, f"messages: the chat template refused them ({first})", "messages") from None

        if uses_tools:
            text = tools.check_template(render_with, [t.for_template() for t in req.tools or []])
        else:
            text = render_with(None)
        bound = CHARS_PER_TOKEN_BOUND * (self.engine.max_context or 1 << 16)
        if len(text) > bound:
            raise ApiError(400, f"messages: the rendered prompt has {len(text)} characters, more than the context "
                           f"({self.engine.max_context} tokens) can hold", "messages", "context_length_exceeded")
        return tok(text, add_special_tokens=False)["input_ids"], text

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: a list of {len(prompt)} prompts; send one request per prompt",
                               "prompt")
            prompt = str(prompt[0])
        if isinstance(prompt, str):
            bound = CHARS_PER_TOKEN_BOUND * (self.engine.max_context or 1 << 16)
            if len(prompt) > bound:
                raise ApiError(400, f"prompt: {len(prompt)} characters cannot fit the context "
                               f"({self.engine.max_context} tokens)", "prompt", "context_length_exceeded")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        else:
            ids = cast("list[int]", list(prompt))  # (a list of strings was taken above)
            vocab = self.engine.info.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               "prompt")
        if not ids:
            raise ApiError(400, "prompt: empty; expected text or token ids", "prompt")
        return ids

    def token_limit(self, req, prompt_tokens: int) -> tuple[int, bool]:
        """The request's token limit, capped to what the target's context has left (said in the dflash object)."""
        limit = req.token_limit()
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        if limit is not None and limit < 1:
            raise ApiError(400, f"{field}: got {limit}, expected >= 1", field)
        room = self.engine.max_context - prompt_tokens if self.engine.max_context else None
        if limit is None:
            if room is None:
                raise ApiError(400, f"{field}: required (the target declares no context length)", field)
            return room, False
        if room is not None and limit > room:
            return room, True
        return limit, False
