"""dflash.server.tools through the openai client: a tiny BPE tokenizer with a Qwen-style template that renders tools,
over a scripted engine (the model's answer is the script): tool calls come back parsed, whole and streamed (no
partial <tool_call> markup ever streamed as content); tool_choice "none" leaves the tools out of the prompt; what the
template or the parser cannot do is refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
import openai  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from test_server_app import ScriptedEngine  # noqa: E402

from dflash.server.app import Server  # noqa: E402

QWEN_STYLE = """{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
ASK = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


class Recording:
    """A tokenizer that keeps the prompts its chat template renders."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.prompts.append(self.tokenizer.apply_chat_template(*args, **kwargs))
        return self.prompts[-1]


def served(tokenizer, answer: str, template: str | None = QWEN_STYLE):
    """An openai client on a server whose model writes `answer` (then EOS), and the prompts its template rendered."""
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine(tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos])
    engine.info = SimpleNamespace(vocab_size=len(tokenizer))
    recording = Recording(tokenizer)
    pipe = SimpleNamespace(engine=engine, tokenizer=recording, eos_token_ids={eos}, backend_name="torch")
    http = TestClient(Server(pipe, model_name="m", chat_template=template).app())
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0)
    return client, http, recording.prompts


def test_tool_calls_come_back_parsed(tokenizer):
    client, http, prompts = served(tokenizer, ANSWER)
    with http:
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] * 2 and len({c.id for c in calls}) == 2
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert '"name": "get_weather"' in prompts[-1] or '"get_weather"' in prompts[-1]


def test_streamed_tool_calls_hold_their_markup_back(tokenizer):
    client, http, _ = served(tokenizer, ANSWER)
    with http:
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200,
                                                     stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = [d.content for d in deltas if d.content]
    assert "".join(content) == "Let me look.\n"
    assert not any("<" in piece for piece in content)  # not even a partial <tool_call>
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)["city"]) for c in calls] == \
        [(0, "get_weather", "Paris"), (1, "get_weather", "Oslo")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_the_tools_out(tokenizer):
    client, http, prompts = served(tokenizer, "Sunny.")
    with http:
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=50)
        assert r.choices[0].message.content == "Sunny." and "<tools>" not in prompts[-1]
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=50)
        assert "<tools>" in prompts[-1]


@pytest.mark.parametrize("fields, param", [
    (dict(tools=TOOLS, tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
    (dict(tool_choice="auto"), "tool_choice"),
    (dict(tools=TOOLS, parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
])
def test_what_cannot_be_served_is_refused_by_name(tokenizer, fields, param):
    client, http, _ = served(tokenizer, "x")
    with http, pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=5, **fields)
    assert e.value.body["param"] == param


def test_a_template_without_tools_refuses_them(tokenizer):
    """The tiny model's own ChatML template renders no tools: a request with tools is refused, not served blind."""
    client, http, _ = served(tokenizer, "x", template=None)
    with http:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=5)
        assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]
        assert client.chat.completions.create(model="m", messages=ASK, max_tokens=5).choices[0].message.content
