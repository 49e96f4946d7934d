"""dflash.server.app over a scripted engine (no model): a thinking model's reasoning and a Qwen-style tool call come
back as reasoning_content / tool_calls, whole and streamed (delta.tool_calls), and `tools` and
`chat_template_kwargs` reach the chat template; the drain's deadline holds while the engine is stuck in a cycle."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dflash.core.admission import Admission  # noqa: E402
from dflash.core.contract import Capabilities, Step  # noqa: E402
from dflash.server.app import Server  # noqa: E402

ALPHABET = [chr(c) for c in range(32, 127)] + ["\n", "<think>", "</think>", "<tool_call>", "</tool_call>", "<eos>"]
EOS = ALPHABET.index("<eos>")


class CharTokenizer:
    """One token per character; the tags are single tokens, as in Qwen's vocabulary."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.seen: list[dict] = []

    def get_vocab(self):
        return {t: i for i, t in enumerate(ALPHABET)}

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in ALPHABET[95:] if text.startswith(t, i)), None)
            ids.append(ALPHABET.index(tag or text[i]))
            i += len(tag) if tag else 1
        return ids

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (i == EOS and skip_special_tokens) else ALPHABET[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        self.seen.append(kwargs)
        opened = "<think>\n" if kwargs.get("enable_thinking", True) else ""
        tools = f"<tools>{json.dumps(kwargs['tools'])}</tools> answer <tool_call>{{json}}</tool_call>\n" \
            if kwargs.get("tools") else ""
        return tools + "".join(m["content"] for m in messages) + "\n" + opened


class ScriptedEngine:
    """The engine protocol dflash.core.loop.Batch drives: every row writes the same script, three tokens a cycle."""

    block_size, max_context, name = 4, 4096, "scripted"
    verify_mode, verify_note, accept_rules, prefix_cache = "chain", "", ["greedy"], None
    info = SimpleNamespace(vocab_size=len(ALPHABET))
    capabilities = Capabilities()

    def __init__(self, script: list[int]):
        self.script, self.rows, self.logprobs, self.first_logprobs, self.last_reused = script, [], None, None, 0
        self.shared, self.cached_tokens, self.chunks = False, [], 0

    def set_sampling(self, params):
        pass

    def prefill(self, prompts):
        self.rows = [0]
        return [self.script[0]]

    def admit(self, prompt, sampling=None):
        self.rows.append(0)
        return self.script[0]

    def begin_prefill(self, prompt, sampling=None, chunk=None):
        """Its prompt in chunks of `chunk` tokens (nothing is computed: each chunk is counted)."""
        chunk = chunk or len(prompt)
        steps = [None] * ((len(prompt) - 1) // chunk) + [self.script[0]]

        def chunks():
            for first in steps:
                self.chunks += 1
                yield first
        return Admission(self, chunks(), len(prompt))

    begin_admit = begin_prefill

    def end_admit(self, admission, alone=False):
        self.rows.append(0)
        return admission.first

    def step(self, anchors):
        out = []
        for i in range(len(self.rows)):
            at = self.rows[i] = self.rows[i] + 1
            out.append(Step(self.script[1 + 3 * (at - 1): 1 + 3 * at], [], 3))
        return out

    def retire(self, rows):
        self.rows = [r for i, r in enumerate(self.rows) if i not in set(rows)]

    def reset(self):
        self.rows = []


def client_for(answer: str):
    tok = CharTokenizer()
    engine = ScriptedEngine(tok.encode(answer) + [EOS])
    pipe = SimpleNamespace(engine=engine, tokenizer=tok, eos_token_ids={EOS}, backend_name="torch")
    return TestClient(Server(pipe, model_name="m").app()), tok


ANSWER = ("Let me think.\n</think>\n\nI will call it.<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_reasoning_and_tool_calls_whole():
    client, tok = client_for(ANSWER)
    with client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather?"}],
                                                      "tools": TOOLS, "max_tokens": 500})
    body = r.json()
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "Let me think.\n" and msg["content"] == "I will call it."
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert any(seen.get("tools") == TOOLS for seen in tok.seen)


def test_reasoning_and_tool_calls_streamed():
    client, tok = client_for(ANSWER)
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "max_tokens": 500,
            "stream": True, "chat_template_kwargs": {"enable_thinking": True}}
    with client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "I will call it."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert tok.seen[-1]["enable_thinking"] is True


def test_thinking_off_is_all_content():
    client, _ = client_for("Just the answer.")
    with client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "Just the answer." and "reasoning_content" not in msg


def test_sampling_defaults_come_from_generation_config(tmp_path):
    """--default-sampling model: the fields a request leaves out take generation_config.json's, then OpenAI's."""
    from dflash.core.errors import DFlashError
    from dflash.core.sampling import SamplingParams
    from dflash.server.intake import model_sampling_defaults
    from dflash.server.protocol import ChatRequest

    assert model_sampling_defaults(tmp_path) == {}  # no file: OpenAI's defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6,
                                                                 "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    defaults = model_sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_p": 0.5})
    assert req.sampling(defaults) == SamplingParams(temperature=0.6, top_p=0.5, top_k=20)
    assert req.sampling() == SamplingParams(temperature=1.0, top_p=0.5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 0}))
    with pytest.raises(DFlashError, match="--default-sampling openai"):
        model_sampling_defaults(tmp_path)


def test_validate_normalises_like_vllm():
    from dflash.core.errors import DFlashError
    from dflash.core.sampling import SamplingParams

    assert SamplingParams(temperature=3e-38).validate().greedy
    assert SamplingParams(temperature=1e-5).validate().temperature == 1e-5
    assert SamplingParams(top_k=-1).validate().top_k == 0
    for bad in (1e-45, 0.0, 1e30):
        with pytest.raises(DFlashError, match="--repetition-penalty"):
            SamplingParams(repetition_penalty=bad).validate()


class StuckEngine(ScriptedEngine):
    """Its third cycle does not return until `release` is set: an engine thread inside a long cycle."""

    def __init__(self, script: list[int]):
        super().__init__(script)
        self.cycles, self.stuck, self.release = 0, threading.Event(), threading.Event()

    def step(self, anchors):
        self.cycles += 1
        if self.cycles == 3:
            self.stuck.set()
            self.release.wait(30)
        return super().step(anchors)


def test_drain_ends_streams_while_the_engine_is_inside_a_cycle():
    """At --drain-timeout the event loop ends the running streams itself (error event, [DONE]) and the drain
    returns, though the engine thread has not come back from its cycle (once: the error event came from the engine
    thread, after its cycle, and uvicorn had cancelled the streams by then)."""
    tok = CharTokenizer()
    engine = StuckEngine(tok.encode("x" * 200) + [EOS])
    pipe = SimpleNamespace(engine=engine, tokenizer=tok, eos_token_ids={EOS}, backend_name="torch")
    server = Server(pipe, model_name="m", drain_timeout=0.5)
    lines = []

    def stream():
        body = {"prompt": "q", "max_tokens": 150, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines.extend(line for line in r.iter_lines() if line)

    with TestClient(server.app()) as client:
        t = threading.Thread(target=stream)
        t.start()
        assert engine.stuck.wait(30)
        t0 = time.monotonic()
        client.portal.call(server.drain, t0)
        t.join(10)
        elapsed = time.monotonic() - t0
        assert not t.is_alive() and not engine.release.is_set()
        assert client.get("/health").status_code == 503
        engine.release.set()
    assert 0.5 <= elapsed < 1.5, elapsed
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-2]) == "x" * 7  # prefill + two cycles
