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


def test_mlx_server_batches_concurrent_requests(server):
    """Continuous batching on MLX: four requests at once decode as rows of one batch, each equal to the same prompt
    served alone."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range("]

    def complete(prompt):
        r = client.completions.create(model="dflash-bundled", prompt=prompt, max_tokens=24, temperature=0)
        return r.choices[0].text

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts))
    assert together == alone
    metrics = httpx.get(server.url + "/metrics").text
    single = next(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith('dflash_step_rows_bucket{le="1.0"}'))
    total = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("dflash_step_rows_count"))
    assert total > single, "no engine step decoded two rows or more"


def test_greedy_rows_with_a_repetition_penalty_join_greedy_streams(start_server):
    """A long greedy stream, then a greedy request with repetition_penalty: both once ended with 'engine failure:
    IndexError' (a penalised row's tree padded to a wider row's had no history for its padding slots), and so did
    the reverse and two penalised rows. --verify auto on a CPU gives the rows trees of their own widths."""
    from serving import penalised_rows_join_greedy_streams

    penalised_rows_join_greedy_streams(start_server("--backend", "mlx", "--verify", "auto"))


@pytest.mark.slow
def test_penalty_fields_equal_target_only_decoding(server):
    """presence_penalty, frequency_penalty and logit_bias (once accepted and ignored): the server's speculative
    greedy output with each equals python -m dflash.generate --no-draft's with the same flag, and differs from plain
    greedy output."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    prompt = "import os\n"
    plain = generate("--prompt", prompt, "--max-new-tokens", "40", "--no-draft")
    cases = [({"presence_penalty": 1.5}, ["--presence-penalty", "1.5"]),
             ({"frequency_penalty": 0.8}, ["--frequency-penalty", "0.8"]),
             ({"logit_bias": {str(plain["tokens"][2]): -100}}, ["--logit-bias", f"{plain['tokens'][2]}:-100"])]
    for field, flags in cases:
        r = client.completions.create(model="dflash-bundled", prompt=prompt, max_tokens=40, temperature=0, **field)
        want = generate("--prompt", prompt, "--max-new-tokens", "40", "--no-draft", *flags)
        assert r.choices[0].text == want["text"] != plain["text"], field


def test_mlx_logprobs_are_finite_and_join_to_the_text(server):
    from serving import logprobs_are_finite_and_join_to_the_text

    logprobs_are_finite_and_join_to_the_text(server.url)
