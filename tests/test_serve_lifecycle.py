"""dflash.serve at the start of its life, under pressure and at its end (one server, one row, a queue of one): a bad
or busy --port refused in one line at once; 503 with Retry-After when full, the second turn of a conversation
prefilled from the cached first, `dflash.data regenerate --endpoint` against the in-process path (resumed after a torn
write), SIGTERM while a stream runs (it finishes, exit 0); the drain (/health unready, 503 to new work, the
listener open until the drain ends) and its deadline met with both cores busy."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]


def serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "dflash.serve", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_port_out_of_range_is_one_line():
    r = serve("--port", "99999")
    assert (r.returncode, r.stderr) == (2, "error: --port: got 99999, expected 0 .. 65535\n")


@pytest.mark.parametrize("backend", BACKENDS)
def test_port_in_use_is_one_line_before_the_model_loads(backend):
    """Once: 'serving ... on http://127.0.0.1:8002' logged, then a failure, then a hang (the engine thread kept the
    process alive)."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = serve("--backend", backend, "--port", str(port))
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: --port {port}: already in use on 127.0.0.1 (another server?); choose another --port\n"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-batch", "1", "--max-queue", "1", "--drain-timeout", "60", "--verify", "chain")


def complete(server, body, **kw):
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120, **kw)


def test_the_readmes_openai_snippet_works_as_written(server):
    pytest.importorskip("openai")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "from openai" in block)
    assert "http://127.0.0.1:8000/v1" in snippet
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet.replace("http://127.0.0.1:8000", server.url), {})
    body = {"messages": [{"role": "user", "content": "def fib(n):"}], "temperature": 0, "max_tokens": 64}
    expected = complete(server, body).json()["choices"][0]["message"]["content"]
    assert out.getvalue() == expected + "\n"


def test_full_queue_answers_503_with_retry_after(server):
    long = {"messages": [{"role": "user", "content": "def main():"}], "max_tokens": 240, "temperature": 0}
    results = []
    threads = [threading.Thread(target=lambda: results.append(complete(server, long).status_code))
               for _ in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads[1].start()  # waits in the queue
    while httpx.get(server.url + "/health").json()["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = complete(server, long)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "server_busy"
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_second_turn_prefills_only_the_new_turn(server):
    """The kept prefix of turn 1 survives an unrelated request in between; the output is the fresh prefill's."""
    import dflash

    first = [{"role": "user", "content": "def fibonacci(n):"}]
    a = complete(server, {"messages": first, "max_tokens": 24, "temperature": 0}).json()
    turn2 = first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "class Stack:"}]
    complete(server, {"messages": [{"role": "user", "content": "import sys"}], "max_tokens": 4})  # in between
    b = complete(server, {"messages": turn2, "max_tokens": 24, "temperature": 0}).json()
    reused, prompt = b["dflash"]["prompt_tokens_reused"], b["usage"]["prompt_tokens"]
    assert a["usage"]["prompt_tokens"] <= reused < prompt  # only the new turn (and the reply's tail) prefilled
    pipe = dflash.load(backend="torch", device="cpu", verify="chain")
    ids = pipe.tokenizer.apply_chat_template(turn2, add_generation_prompt=True, tokenize=False)
    want = pipe.generate(pipe.tokenizer(ids, add_special_tokens=False)["input_ids"], max_new_tokens=24)
    assert b["choices"][0]["message"]["content"] == want.text
    from prometheus_client.parser import text_string_to_metric_families

    m = {s.name: s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
         for s in f.samples}
    assert m["dflash_prefill_tokens_total"] < m["dflash_prompt_tokens_total"] and m["dflash_prefix_cache_bytes"] > 0


def test_seeded_sampling_repeats_under_chain_verification(server):
    body = {"messages": [{"role": "user", "content": "class Stack:"}], "max_tokens": 24, "temperature": 0.8,
            "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7}
    a, b = complete(server, body).json(), complete(server, body).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["dflash"]["verify_mode"] == "chain"
    other = complete(server, dict(body, seed=8)).json()
    assert other["choices"][0]["message"]["content"] != a["choices"][0]["message"]["content"]


def test_data_regenerate_through_the_server(server, tmp_path):
    from dflash.backends.torch.regeneration import regenerate
    from dflash.reference import TARGET_DIR
    from dflash.remote_regeneration import regenerate_remote

    prompts = tmp_path / "prompts.jsonl"
    texts = ["def add(a, b):", "class Queue:", "import re", "def main():", "x = [1, 2"]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    local = tmp_path / "local.jsonl"
    regenerate(TARGET_DIR, prompts, local, batch_size=2, max_new_tokens=24, device="cpu", progress=False,
               log=lambda m: None)
    remote = tmp_path / "remote.jsonl"
    regenerate_remote(server.url, prompts, remote, concurrency=3, max_new_tokens=24, log=lambda m: None)
    lines = remote.read_text().splitlines(keepends=True)
    remote.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # killed mid-write after one answer
    stats = regenerate_remote(server.url + "/v1", prompts, remote, concurrency=2, max_new_tokens=24,
                              log=lambda m: None)
    assert stats["ok"] == stats["total"] == len(texts)

    def by_id(path):
        return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}

    want, got = by_id(local), by_id(remote)
    assert got.keys() == want.keys()
    for rid in want:
        for key in ("messages", "status", "finish_reason", "prompt_tokens", "answer_tokens", "thinking"):
            assert got[rid][key] == want[rid][key], (rid, key)


def test_sigterm_while_streaming_drains_and_exits_0(server):
    body = {"messages": [{"role": "user", "content": "def main():"}], "max_tokens": 300, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    final = json.loads(rest[-2][len("data: "):])
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.proc.wait(10) == 0  # the drain ends with its last response, not at --drain-timeout 60
    assert "Traceback" not in server.log()


def sse_events(lines: list[str]) -> list:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):]) for line in lines]


def long_stream(url: str, i: int, out: list, started: threading.Barrier | None = None) -> None:
    """A completion that cannot finish within the drains below (1900 tokens, no stop); out[i] = its events."""
    body = {"prompt": f"def f{i}(x):", "max_tokens": 1900, "temperature": 0, "stream": True, "stop": ["@@never@@"]}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        if started is not None:
            started.wait(timeout=60)
        out[i] = sse_events([first] + [line for line in lines if line])


@pytest.mark.parametrize("backend", BACKENDS)
def test_drain_answers_503_and_closes_the_listener_after(start_server, backend):
    """During the drain the listener stays open: /health is 503 "draining", a new request 503 with Retry-After (once:
    refused at connect, where a load balancer never saw a 503); at --drain-timeout the running stream ends with an
    error event and [DONE], a whole response with 503; then the process exits 0 and the port is closed."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    s = start_server("--backend", backend, "--drain-timeout", "4", "--max-batch", "2", "--verify", "chain")
    streams, whole = [None], {}
    stream = threading.Thread(target=long_stream, args=(s.url, 0, streams))
    stream.start()
    deadline = time.monotonic() + 60
    while httpx.get(s.url + "/health").json()["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    body = {"prompt": "class A:", "max_tokens": 1900, "temperature": 0, "stop": ["@@never@@"]}
    waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(s.url + "/v1/completions", json=body,
                                                                        timeout=60)))
    waiting.start()
    while httpx.get(s.url + "/health").json()["running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    health = httpx.get(s.url + "/health")
    while health.status_code == 200 and time.monotonic() < t0 + 2:
        health = httpx.get(s.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert httpx.get(s.url + "/metrics").status_code == 200  # scrapers still served
    assert s.proc.wait(30) == 0
    elapsed = time.monotonic() - t0
    stream.join(timeout=30)
    waiting.join(timeout=30)
    assert 4 <= elapsed < 6, elapsed
    events = streams[0]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
    assert whole["r"].status_code == 503 and whole["r"].headers["Retry-After"] == "1"
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
    assert "Traceback" not in s.log() and "timeout graceful shutdown exceeded" not in s.log()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_drain_deadline_holds_with_every_core_busy(start_server, backend):
    """Six long streams while other processes keep every core busy: SIGTERM with --drain-timeout 4 exits 0 within
    6 s and every stream ends with an error event and [DONE] (once: 9.8 s, uvicorn cancelled the responses while the
    engine thread was inside a cycle, and every stream was cut bare)."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    drain, n = 4.0, 6
    s = start_server("--backend", backend, "--drain-timeout", str(drain), "--max-batch", str(n), "--verify", "chain")
    streams, started = [None] * n, threading.Barrier(n + 1)
    threads = [threading.Thread(target=long_stream, args=(s.url, i, streams, started)) for i in range(n)]
    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"
    busy = []
    try:
        for t in threads:
            t.start()
        started.wait(timeout=60)
        busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
        time.sleep(1)  # the busy loops running, the streams slowed down
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for t in threads:
        t.join(timeout=30)
    assert code == 0 and elapsed < drain + 2, (code, elapsed, s.log()[-2000:])
    for events in streams:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
    assert "Traceback" not in s.log() and "timeout graceful shutdown exceeded" not in s.log()
