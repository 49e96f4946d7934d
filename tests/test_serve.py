"""python -m dflash.serve as a real process on 127.0.0.1 (the bundled pair), through the official openai client and
raw HTTP: chat and completions, streamed and not; 16 concurrent greedy clients against their batch-1 outputs; a
client that disconnects mid-stream; the bad-request matrix; /metrics in Prometheus text."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "test-key"
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def parse(text):", "for i in range(10):",
           "def __init__(self, name):", "try:\n    import json", "return [x for x in", "def read(path):",
           "while True:", "if __name__ == '__main__':", "def add(a, b):", "class Node(object):", "with open(",
           "def sort(items, key=None):", "raise ValueError("]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--api-key", KEY, "--max-request-bytes", "65536", "--max-batch", "16")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo():
    """The same pair in this process, one prompt at a time: the batch-1 reference."""
    import dflash

    return dflash.load(backend="torch", device="cpu")


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers=headers, timeout=60, **kw)


def metrics(server) -> dict:
    out = {}
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["dflash-bundled"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 16 and health["prefilling"] == 0


def test_completion_equals_batch1_and_stream_equals_whole(client, solo):
    want = solo.generate(PROMPTS[0], max_new_tokens=40)
    r = client.completions.create(model="dflash-bundled", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.tokens) and r.usage.prompt_tokens == want.prompt_tokens
    stats = r.model_extra["dflash"]
    histogram = stats["acceptance_histogram"]
    assert stats["verify_mode"] == want.verify_mode and stats["cycles"] > 0
    assert sum(histogram) == stats["cycles"] and stats["tau"] > 1
    # every accepted draft token was verified (auto's cycles without a draft forward verify none: fewer verified
    # tokens than cycles is possible)
    assert stats["verified_tokens"] >= sum((n - 1) * count for n, count in enumerate(histogram, start=1))
    chunks = list(client.completions.create(prompt=PROMPTS[0], model="dflash-bundled", max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_whole(client, solo):
    messages = [{"role": "user", "content": "def quicksort(xs):"}]
    want = solo.generate("def quicksort(xs):", chat=True, max_new_tokens=32)
    r = client.chat.completions.create(model="dflash-bundled", messages=messages, max_completion_tokens=32,
                                       temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    stream = client.chat.completions.create(model="dflash-bundled", messages=messages, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.total_tokens == want.prompt_tokens + len(want.tokens)


def test_stop_strings_and_sampling_fields(client):
    r = client.completions.create(model="dflash-bundled", prompt=PROMPTS[0], max_tokens=64, temperature=0,
                                  stop=["\n"])
    assert "\n" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    kw = dict(model="dflash-bundled", prompt=PROMPTS[1], max_tokens=24, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"


def test_logprobs_are_the_targets(client, solo):
    """Greedy: the emitted token is the top-1 alternative and its log-probability is the largest one."""
    r = client.chat.completions.create(model="dflash-bundled", messages=[{"role": "user", "content": "class A:"}],
                                       max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    c = client.completions.create(model="dflash-bundled", prompt="def f(", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) == 2 for t in lp.top_logprobs)


def test_logprobs_are_finite_and_join_to_the_text(server):
    from serving import logprobs_are_finite_and_join_to_the_text

    logprobs_are_finite_and_join_to_the_text(server.url, {"Authorization": f"Bearer {KEY}"})


def test_the_served_model_can_be_retrieved(client):
    assert client.models.retrieve("dflash-bundled").id == "dflash-bundled"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_sixteen_concurrent_clients_equal_batch1(server, client, solo):
    want = [solo.generate(p, max_new_tokens=48).text for p in PROMPTS]
    got, errors = [None] * len(PROMPTS), []
    peak = [0]

    def one(i):
        try:
            r = client.completions.create(model="dflash-bundled", prompt=PROMPTS[i], max_tokens=48, temperature=0)
            got[i] = r.choices[0].text
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(repr(e))

    def watch():
        while any(t.is_alive() for t in threads):
            peak[0] = max(peak[0], httpx.get(server.url + "/health").json()["running"])
            time.sleep(0.02)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads + [watcher]:
        t.join()
    assert not errors
    assert got == want
    assert peak[0] > 1, "the requests never shared a batch"


def test_disconnect_mid_stream_frees_the_row(server):
    before = metrics(server).get(("dflash_requests_total", (("endpoint", "/v1/completions"),
                                                            ("outcome", "cancelled"))), 0)
    body = {"prompt": PROMPTS[2], "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(server.url + "/health").json()["running"] == 1
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.get(server.url + "/health").json()["running"] == 0
    after = metrics(server)[("dflash_requests_total", (("endpoint", "/v1/completions"), ("outcome", "cancelled")))]
    assert after == before + 1


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", dict(CHAT, temperature="0.5"), 400, "temperature"),
    ("/v1/chat/completions", dict(CHAT, max_tokens="4"), 400, "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, model="gpt-4"), 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", dict(CHAT, max_tokens=-5), 400, "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, n=2), 400, "n"),
    ("/v1/chat/completions", dict(CHAT, top_p=1.5), 400, "top_p"),
    ("/v1/chat/completions", dict(CHAT, temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", dict(CHAT, seed=2 ** 70), 400, "seed"),
    ("/v1/chat/completions", dict(CHAT, seed=-1), 400, "seed"),
    ("/v1/chat/completions", dict(CHAT, top_k=-3), 400, "top_k"),
    ("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", [1, 2, 3], 400, "body"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "def " * 3000}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert "Traceback" not in server.log()


def test_refusals_before_the_body(server):
    r = post(server, "/v1/chat/completions", CHAT, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(server, "/v1/completions", json.dumps({"prompt": "x" * 70_000}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(server, "/v1/nothing", CHAT)
    assert r.status_code == 404 and "error" in r.json()
    long = post(server, "/v1/completions", {"prompt": "def " * 3000}).json()["error"]
    assert long["code"] == "context_length_exceeded" and "2048" in long["message"]


def test_huge_max_tokens_is_capped_to_the_context(server):
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 10 ** 9, "temperature": 0,
                                         "stop": ["\n\n"]}).json()
    assert r["dflash"]["max_tokens_capped"] and r["dflash"]["max_tokens"] == 2048 - r["usage"]["prompt_tokens"]


def test_metrics_and_access_log(server, client):
    client.completions.create(model="dflash-bundled", prompt="x = 1", max_tokens=8, temperature=0)
    m = metrics(server)
    ok = m[("dflash_requests_total", (("endpoint", "/v1/completions"), ("outcome", "ok")))]
    assert ok >= 1 and m[("dflash_generation_tokens_total", ())] > 0
    assert m[("dflash_cycles_total", ())] > 0 and m[("dflash_draft_accepted_total", (("position", "1"),))] > 0
    assert m[("dflash_time_to_first_token_seconds_count", ())] >= ok
    taus = sum(v for (name, _), v in m.items() if name == "dflash_request_tau_count")  # one series per rule
    assert taus >= ok and m[("dflash_inter_token_latency_seconds_count", ())] > 0
    assert ("dflash_queue_depth", ()) in m and ("dflash_batch_size", ()) in m
    assert m[("dflash_requests_total", (("endpoint", "/v1/chat/completions"), ("outcome", "rejected")))] > 0
    access = [line for line in server.log().splitlines() if "dflash.serve.access" in line]
    assert any("POST /v1/completions 200" in line and "outcome=ok" in line for line in access)


@pytest.mark.parametrize("accept", ["auto", "match"])  # (auto: a seeded request matches)
def test_seeded_requests_reproduce_under_the_default_verify_mode(client, accept):
    """The same seeded sampled request, alone three times and then beside two others: the same tokens every time
    (every draw is keyed by the token's position, whatever auto verified or the batch held)."""
    kw = dict(model="dflash-bundled", prompt=PROMPTS[2], max_tokens=40, temperature=0.8, seed=11,
              extra_body={"accept": accept})
    alone = [client.completions.create(**kw).choices[0].text for _ in range(3)]
    together = [None] * 3

    def one(i):
        body = kw if i == 0 else {**kw, "prompt": PROMPTS[i], "seed": i}
        together[i] = client.completions.create(**body).choices[0].text

    greedy = {}

    def greedy_beside():  # a greedy request in a batch with sampled rows stays target-only greedy
        greedy["text"] = client.completions.create(model="dflash-bundled", prompt=PROMPTS[3], max_tokens=40,
                                                   temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)] + [threading.Thread(target=greedy_beside)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert alone[0] == alone[1] == alone[2] == together[0]
    assert greedy["text"] == client.completions.create(model="dflash-bundled", prompt=PROMPTS[3], max_tokens=40,
                                                       temperature=0).choices[0].text


@pytest.mark.slow  # (the MLX server's, where the batch failed, runs by default)
def test_greedy_rows_with_a_repetition_penalty_join_greedy_streams(start_server):
    """tests/test_serve_mlx.py's case on PyTorch: penalised and plain greedy rows in trees of their own widths."""
    from serving import penalised_rows_join_greedy_streams

    penalised_rows_join_greedy_streams(start_server("--backend", "torch", "--verify", "auto"))


def test_penalty_fields_equal_target_only_decoding(client):
    """presence_penalty, frequency_penalty and logit_bias (once accepted and ignored): the server's speculative
    greedy output with each equals target-only greedy output with it, and differs from plain greedy output."""
    import dflash

    target_only = dflash.load(backend="torch", device="cpu", no_draft=True)
    prompt = PROMPTS[2]
    plain = target_only.generate(prompt, max_new_tokens=40)
    fields = [{"presence_penalty": 1.5}, {"frequency_penalty": 0.8}, {"logit_bias": {str(plain.tokens[2]): -100}}]
    for field in fields:
        r = client.completions.create(model="dflash-bundled", prompt=prompt, max_tokens=40, temperature=0, **field)
        bias = tuple((int(k), float(v)) for k, v in field.pop("logit_bias", {}).items())
        want = target_only.generate(prompt, max_new_tokens=40, logit_bias=bias, **field)
        assert r.choices[0].text == want.text != plain.text, field
