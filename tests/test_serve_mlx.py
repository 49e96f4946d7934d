"""python -m dflash.serve --backend mlx as a real process (the bundled pair): the engine thread owns its MLX stream
(the model is loaded on it), so requests are served (once: every one a 500, 'There is no Stream(cpu, 0) in current
thread'); greedy output equals python -m dflash.generate --backend mlx on the same prompt; chat streams."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--backend", "mlx", "--verify", "chain")


def generate(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "dflash.generate", "--backend", "mlx", "--verify", "chain", "--json",
                          "--temperature", "0", *args], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def test_mlx_server_equals_generate(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    want = generate("--prompt", "def fibonacci(n):", "--max-new-tokens", "32")
    r = client.completions.create(model="dflash-bundled", prompt="def fibonacci(n):", max_tokens=32, temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.model_extra["dflash"]["verify_mode"] == "chain"
    r = client.chat.completions.create(model="dflash-bundled", messages=[{"role": "user", "content": "class Stack:"}],
                                       max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    assert "Traceback" not in server.log()
