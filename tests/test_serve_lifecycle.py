"""dflash.serve under pressure and at the end of its life (one server, one row, a queue of one): 503 with
Retry-After when full, the second turn of a conversation prefilled from the cached first, `dflash.data regenerate
--endpoint` against the in-process path (resumed after a torn write), and SIGTERM while a stream runs (it finishes,
exit 0)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")


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
    assert server.proc.wait(60) == 0
    assert "Traceback" not in server.log()
