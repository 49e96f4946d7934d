"""dflash.server.parsing: reasoning / content / tool calls split the same way whatever the streamed pieces are."""

import json

import pytest

from dflash.server.parsing import Delta, OutputParser, starts_in_reasoning


def run(text, pieces, **kw):
    parser, total = OutputParser(**kw), Delta()
    for i in range(0, len(text), pieces):
        d = parser.feed(text[i:i + pieces])
        total.reasoning += d.reasoning
        total.content += d.content
        total.tool_calls += d.tool_calls
    d = parser.feed("", final=True)
    total.reasoning += d.reasoning
    total.content += d.content
    total.tool_calls += d.tool_calls
    return total


@pytest.mark.parametrize("pieces", [1, 2, 3, 5, 7, 100])
def test_reasoning_then_answer(pieces):
    t = run("<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.", pieces, reasoning=True)
    assert t.reasoning == "\nLet me add 2 and 2.\n" and t.content == "The answer is 4." and not t.tool_calls


@pytest.mark.parametrize("pieces", [1, 4, 100])
def test_template_opened_the_think_block(pieces):
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<think>\n\n</think>\n\n")
    t = run("thinking...</think>\n\nDone.", pieces, reasoning=True, in_reasoning=True)
    assert t.reasoning == "thinking..." and t.content == "Done."


@pytest.mark.parametrize("pieces", [1, 3, 6, 100])
def test_tool_calls(pieces):
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    text = f"Let me check.\n<tool_call>\n{json.dumps(call)}\n</tool_call>\n<tool_call>\n" \
           f'{{"name": "now", "arguments": {{}}}}\n</tool_call>'
    t = run(text, pieces, tools=True)
    assert t.content.strip() == "Let me check."
    assert [c["function"]["name"] for c in t.tool_calls] == ["get_weather", "now"]
    assert [c["index"] for c in t.tool_calls] == [0, 1]
    assert json.loads(t.tool_calls[0]["function"]["arguments"]) == call["arguments"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in t.tool_calls)


def test_not_a_tool_call_stays_content():
    t = run("<tool_call>not json</tool_call> and <tool_call>{\"name\": ", 4, tools=True)
    assert not t.tool_calls
    assert t.content == "<tool_call>not json</tool_call> and <tool_call>{\"name\": "


def test_plain_text_untouched_without_the_features():
    text = "a <think> b </think> <tool_call>{}</tool_call> <"
    assert run(text, 3).content == text
