"""dflash.server.protocol: every field of OpenAI's request types is served or refused by name (held against the
installed openai package, so a field it adds fails here until it is decided), refusals name the field, and unknown
fields, too many or too long stop strings and stream_options without a stream are refused."""

from __future__ import annotations

import json
import typing

import pytest

pytest.importorskip("fastapi")
from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

from dflash.server.intake import parse_body  # noqa: E402
from dflash.server.protocol import (  # noqa: E402
    CHAT_NOT_SERVED, COMPLETION_NOT_SERVED, MAX_STOP_CHARS, NOT_SERVED, ApiError, ChatRequest, CompletionRequest)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def openai_fields(module) -> set[str]:
    return {name for params in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
            for name in typing.get_type_hints(params)}


@pytest.mark.parametrize("module, model, not_served", [
    (chat_create_params, ChatRequest, CHAT_NOT_SERVED),
    (completion_create_params, CompletionRequest, COMPLETION_NOT_SERVED)])
def test_every_openai_field_is_served_or_refused(module, model, not_served):
    fields = openai_fields(module)
    assert "stream" in fields and len(fields) > 10  # (the types were read)
    undecided = fields - set(model.model_fields) - set(not_served)
    assert not undecided, f"OpenAI request fields neither served nor refused: {sorted(undecided)}"
    assert not set(model.model_fields) & set(not_served)


def refusal(body: dict, chat: bool) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_body(json.dumps(body).encode(), chat)
    assert e.value.status == 400
    return e.value


ASKING = {"n": 2, "best_of": 3, "echo": True, "suffix": "x", "response_format": {"type": "json_object"},
          "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": False,
          "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"},
          "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
          "service_tier": "flex", "web_search_options": {}, "store": True, "moderation": {"x": 1},
          "prompt_cache_retention": "24h", "prompt_cache_options": {}}


@pytest.mark.parametrize("chat", [True, False])
def test_fields_not_served_are_refused_by_name_unless_they_ask_for_nothing(chat):
    base, names = (CHAT, CHAT_NOT_SERVED) if chat else (COMPLETION, COMPLETION_NOT_SERVED)
    assert set(ASKING) >= set(NOT_SERVED)
    for name in names:
        e = refusal(dict(base, **{name: ASKING[name]}), chat)
        assert e.param == name and e.message.startswith(f"{name}: got "), e.message
        for ok in (None, *NOT_SERVED[name][0]):
            parse_body(json.dumps(dict(base, **{name: ok})).encode(), chat)
    assert refusal(dict(base, n=True), chat).param == "n"  # (true == 1 in Python; not as a count)


@pytest.mark.parametrize("chat", [True, False])
def test_unknown_fields_are_refused_by_name(chat):
    base = CHAT if chat else COMPLETION
    e = refusal(dict(base, temprature=0.5), chat)
    assert e.param == "temprature" and "unknown field" in e.message
    assert refusal(dict(base, stream=True, stream_options={"include_usage": True, "x": 1}), chat).param == \
        "stream_options.x"
    other = "best_of" if chat else "tools"  # a field of the other endpoint
    assert refusal(dict(base, **{other: 1}), chat).param == other
    # what the models serve besides OpenAI's fields, and the fields that change nothing in the output
    parse_body(json.dumps(dict(base, top_k=5, min_p=0.1, repetition_penalty=1.1, user="u")).encode(), chat)


def test_stop_strings_are_bounded_and_stream_options_need_a_stream():
    assert refusal(dict(COMPLETION, stop=["a", "b", "c", "d", "e"]), False).param == "stop"
    assert refusal(dict(CHAT, stop="x" * (MAX_STOP_CHARS + 1)), True).param == "stop"
    parse_body(json.dumps(dict(CHAT, stop=["a", "b", "c", "x" * MAX_STOP_CHARS])).encode(), True)
    e = refusal(dict(CHAT, stream_options={"include_usage": True}), True)
    assert e.param == "stream_options" and "stream" in e.message
    parse_body(json.dumps(dict(CHAT, stream=True, stream_options={"include_usage": True})).encode(), True)


def test_tools_are_checked_by_shape():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    req = parse_body(json.dumps(dict(CHAT, tools=[tool])).encode(), True)
    assert [t.for_template() for t in req.tools] == [tool]
    assert refusal(dict(CHAT, tools=[dict(tool, type="custom")]), True).param == "tools[0].type"
    assert refusal(dict(CHAT, tools=[{"type": "function", "function": {"name": "a b"}}]), True).param == \
        "tools[0].function.name"
    assert refusal(dict(CHAT, tools=[]), True).param == "tools"
