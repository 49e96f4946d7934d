"""Cases shared by the server tests of both backends (tests/test_serve.py, tests/test_serve_mlx.py)."""

from __future__ import annotations

import json
import threading

import httpx


def complete(server, prompt: str, max_tokens: int, **fields) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream(server, prompt: str, max_tokens: int, started: threading.Event, out: dict, **fields) -> None:
    """A streamed greedy completion; `started` is set at its first token, out["text"] / out["error"] at its end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **fields}
    text = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
                continue
            text.append(event["choices"][0]["text"])
            started.set()
    started.set()
    out["text"] = "".join(text)


PENALTY = {"repetition_penalty": 1.05}
# a long greedy stream on a prompt prompt-lookup can copy from, and a request that joins it: greedy + penalty joining
# greedy, the reverse, and two penalised rows
JOINS = [({}, PENALTY), (PENALTY, {}), (PENALTY, PENALTY)]
LONG_PROMPT = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
JOIN_PROMPT = "def fibonacci(n):"


def penalised_rows_join_greedy_streams(server) -> None:
    """Each pair of JOINS: the joining request and the running stream both succeed with their outputs alone."""
    for first, second in JOINS:
        want = complete(server, LONG_PROMPT, 96, **first), complete(server, JOIN_PROMPT, 48, **second)
        started, out = threading.Event(), {}
        runner = threading.Thread(target=stream, args=(server, LONG_PROMPT, 96, started, out), kwargs=first)
        runner.start()
        assert started.wait(120)
        joined = complete(server, JOIN_PROMPT, 48, **second)
        runner.join(300)
        assert "error" not in out, (first, second, out["error"])
        assert (out["text"], joined) == want, (first, second)
    log = server.log()
    assert "engine failure" not in log and "batch fault" not in log and "Traceback" not in log, log[-3000:]


def strict_json(text: str):
    """json.loads that refuses what is not JSON (-Infinity, NaN), as strict clients do."""
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def events(r) -> list[dict]:
    return [strict_json(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def logprobs_are_finite_and_join_to_the_text(url: str, headers: dict | None = None) -> None:
    """Under top-k / top-p (alternatives the filters exclude: -9999.0, never -inf) and a stop string (entries stop
    where the text does), streamed or not, on both endpoints: valid JSON, and the entries join to the text."""
    headers = headers or {}
    base = {"prompt": "def fibonacci(n):", "max_tokens": 24, "seed": 3}
    greedy = httpx.post(url + "/v1/completions", json=dict(base, temperature=0), headers=headers, timeout=300)
    text = greedy.json()["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cases = [dict(base, temperature=0.8, top_k=2, logprobs=5), dict(base, temperature=0.8, top_p=0.3, logprobs=5),
             dict(base, temperature=0, logprobs=3, stop=[stop])]
    for body in cases:
        for streamed in (False, True):
            with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=streamed), headers=headers,
                              timeout=300) as r:
                assert r.status_code == 200, r.read()
                choices = [e["choices"][0] for e in (events(r) if streamed else [strict_json(r.read())])]
            out = "".join(c["text"] for c in choices)
            lps = [c["logprobs"] for c in choices if c["logprobs"]]
            tokens = [t for lp in lps for t in lp["tokens"]]
            assert "".join(tokens) == out, (body, streamed)
            assert all(o <= len(out) for lp in lps for o in lp["text_offset"])
            values = [v for lp in lps for v in lp["token_logprobs"]] + \
                [v for lp in lps for top in lp["top_logprobs"] for v in top.values()]
            assert all(-9999.0 <= v <= 0 for v in values)
            if "top_k" in body:
                assert -9999.0 in values and all(len(top) >= 2 for lp in lps for top in lp["top_logprobs"])
            if "stop" in body:
                assert stop not in out and out == text[:text.index(stop)]
    chat = {"messages": [{"role": "user", "content": "class Stack:"}], "max_tokens": 16, "temperature": 0.8,
            "top_k": 2, "logprobs": True, "top_logprobs": 4, "seed": 1}
    for streamed in (False, True):
        with httpx.stream("POST", url + "/v1/chat/completions", json=dict(chat, stream=streamed), headers=headers,
                          timeout=300) as r:
            assert r.status_code == 200, r.read()
            choices = [e["choices"][0] for e in (events(r) if streamed else [strict_json(r.read())])]
        entries = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
        content = "".join((c.get("delta") or c.get("message") or {}).get("content") or "" for c in choices)
        assert entries and "".join(e["token"] for e in entries) == content
        assert any(t["logprob"] == -9999.0 for e in entries for t in e["top_logprobs"])
