"""Soak test of python -m dflash.serve: C clients for M minutes, streamed and whole, chat and completions, with a few
clients that hang up mid-stream, seeded sampled requests, a mix (greedy and seeded sampled requests with repetition /
presence / frequency penalties and a logit bias, log-probabilities under stop strings and under top-k / top-p, beside
plain greedy rows in the same batches) and hostile ones (numerics that once killed every running row, a template in
the request, malformed tool calls, vLLM's top_k -1, penalty fields out of OpenAI's ranges, fields the server does not
serve). Every greedy or seeded answer must equal the one the same request got alone at the start (nothing failed,
nothing garbled), its log-probabilities (when asked) must be strict JSON and join to its text, every hostile request
must get its expected status, and the server's RSS must stay flat after the warm-up (the first minute).

    OMP_NUM_THREADS=1 python scripts/serve_soak.py --minutes 10 --concurrency 16 [--out soak.json]
    python scripts/serve_soak.py --minutes 3 --concurrency 4 --backend mlx
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import httpx

# (body, the status it must get): requests a hostile or careless client sends
HOSTILE = [
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 3e-38}, 200),  # below 1e-5: greedy
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 1.0, "repetition_penalty": 1e-45}, 400),
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 0.7, "top_k": -1}, 200),  # vLLM's "off"
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
      "chat_template_kwargs": {"chat_template": "{% for i in range(999999) %}x{% endfor %}"}}, 400),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": ["abc"]},
                   {"role": "user", "content": "again"}], "max_tokens": 8}, 400),
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "presence_penalty": 2.5}, 400),  # OpenAI's [-2, 2]
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "frequency_penalty": -3}, 400),
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "logit_bias": {"the": 1}}, 400),  # not a token id
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "logit_bias": {"99999999": -100}}, 400),
    ({"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "logit_bias": {"13": 1e9}}, 400),
    # fields the server does not serve are refused by name, never ignored
    ({"prompt": "def f(x):", "max_tokens": 16, "best_of": 3}, 400),
    ({"prompt": "def f(x):", "max_tokens": 16, "temprature": 0}, 400),  # unknown field
    ({"prompt": "def f(x):", "max_tokens": 16, "stop": ["a", "b", "c", "d", "e"]}, 400),
    ({"prompt": "def f(x):", "max_tokens": 16, "stream_options": {"include_usage": True}}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "reasoning_effort": "low"}, 400),
    # (the bundled pair's template renders no tools: refused, not served blind)
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
]
# a request's sampling fields by name: plain greedy, seeded sampled, and the penalty mix (asked on PENALTY_PROMPTS)
SETTINGS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "seed": 7},
    "greedy+repetition": {"temperature": 0, "repetition_penalty": 1.05},
    "greedy+presence": {"temperature": 0, "presence_penalty": 1.0},
    "greedy+frequency": {"temperature": 0, "frequency_penalty": 0.5},
    "greedy+logit_bias": {"temperature": 0, "logit_bias": {"13": -100, "25": 5}},
    "seeded+penalties": {"temperature": 0.8, "seed": 11, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                         "frequency_penalty": 0.3, "logit_bias": {"13": 3}},
    "seeded+repetition": {"temperature": 0.7, "seed": 5, "repetition_penalty": 1.05},
    # log-probabilities (k alternatives) under a stop string and under filters that exclude most alternatives:
    # every answer's entries must be valid JSON and join to its text
    "greedy+stop+logprobs": {"temperature": 0, "stop": ["\n\n", "return"], "logprobs": 3},
    "seeded+filters+logprobs": {"temperature": 0.8, "seed": 3, "top_k": 4, "top_p": 0.9, "logprobs": 5},
}
PENALTY_MIX = [name for name in SETTINGS if "+" in name]  # (the mix: penalties, logprobs, stops, filters)
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def parse(text):", "for i in range(10):",
           "def __init__(self, name):", "try:\n    import json", "def read(path):", "while True:",
           "if __name__ == '__main__':", "def add(a, b):", "class Node(object):", "with open(",
           "def sort(items, key=None):", "raise ValueError(", "return [x for x in"]
PENALTY_PROMPTS = PROMPTS[:4]


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hostile(url: str, body: dict) -> int:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(url + path, json=body, timeout=300).status_code


def strict_json(text: str):
    """JSON as a strict client reads it: -Infinity or NaN is an error."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def logprob_tokens(choice: dict, chat: bool) -> list[str]:
    lp = choice.get("logprobs")
    if not lp:
        return []
    return [e["token"] for e in lp["content"]] if chat else lp["tokens"]


def ask(url: str, prompt: str, max_tokens: int, stream: bool, chat: bool, hang_up: bool = False,
        setting: str = "greedy") -> str | None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": max_tokens, "stream": stream, **SETTINGS[setting]}
    if chat and "logprobs" in body:  # (chat spells k as top_logprobs)
        body.update(logprobs=True, top_logprobs=body["logprobs"])
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    text, tokens = [], []
    if not stream:
        r = httpx.post(url + path, json=body, timeout=300)
        r.raise_for_status()
        c = strict_json(r.text)["choices"][0]
        text.append(c["message"]["content"] if chat else c["text"])
        tokens += logprob_tokens(c, chat)
    else:
        with httpx.stream("POST", url + path, json=body, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if hang_up and len(text) > 2:
                    return None
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = strict_json(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"]:
                    c = chunk["choices"][0]
                    text.append((c["delta"].get("content") or "") if chat else c["text"])
                    tokens += logprob_tokens(c, chat)
    out = "".join(text)
    if "logprobs" in body and "".join(tokens) != out:
        raise RuntimeError(f"logprobs: the tokens join to {''.join(tokens)[:40]!r}, the text is {out[:40]!r}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", help="write the figures here as JSON")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "mlx"), help="the server's --backend")
    p.add_argument("--penalty-share", type=float, default=0.25,
                   help="share of the checked requests drawn from the penalty mix (default: %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], help="extra dflash.serve flag (repeatable)")
    args = p.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dflash.serve", "--port", str(port), "--max-batch",
                             str(args.concurrency), "--backend", args.backend, "--log-level", "warning",
                             *args.server_arg],
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        asked = [(pr, chat, setting) for chat in (False, True)
                 for pr, setting in [(pr, s) for pr in PROMPTS for s in ("greedy", "seeded")] +
                 [(pr, s) for pr in PENALTY_PROMPTS for s in PENALTY_MIX]]
        want = {key: ask(url, key[0], args.max_tokens, False, key[1], setting=key[2]) for key in asked}
        counts = {"ok": 0, "failed": 0, "garbled": 0, "garbled_seeded": 0, "hung_up": 0, "hostile_ok": 0,
                  "hostile_wrong": 0}
        by_setting = {name: {"ok": 0, "different": 0, "failed": 0} for name in SETTINGS}
        errors: list[str] = []
        lock = threading.Lock()
        start = time.monotonic()
        end = start + 60 * args.minutes

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                chat, stream = rng.random() < 0.5, rng.random() < 0.7
                hang_up = stream and rng.random() < 0.05
                if rng.random() < args.penalty_share:
                    pr, setting = rng.choice(PENALTY_PROMPTS), rng.choice(PENALTY_MIX)
                else:
                    pr, setting = rng.choice(PROMPTS), "seeded" if rng.random() < 0.2 else "greedy"
                checked = None  # the setting of a checked answer: its outcome is counted per setting too
                try:
                    if rng.random() < 0.1:
                        body, status = rng.choice(HOSTILE)
                        kind = "hostile_ok" if hostile(url, body) == status else "hostile_wrong"
                    else:
                        checked = setting
                        got = ask(url, pr, args.max_tokens, stream, chat, hang_up, setting)
                        kind = "hung_up" if got is None else "ok" if got == want[(pr, chat, setting)] else \
                            "garbled_seeded" if "seed" in SETTINGS[setting] else "garbled"
                except Exception as e:  # noqa: BLE001  (counted and reported)
                    kind = "failed"
                    with lock:
                        errors.append(f"{checked or 'hostile'}: {e!r}"[:200])
                with lock:
                    counts[kind] += 1
                    if checked is not None and kind != "hung_up":
                        outcome = "ok" if kind == "ok" else "failed" if kind == "failed" else "different"
                        by_setting[checked][outcome] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        rss = []
        while any(t.is_alive() for t in threads):
            rss.append((round(time.monotonic() - start), round(rss_mb(proc.pid), 1)))
            time.sleep(10)
        for t in threads:
            t.join()
        warm = [m for s, m in rss if s >= 60] or [m for _, m in rss]
        health = httpx.get(url + "/health").json()
        report = {"minutes": args.minutes, "concurrency": args.concurrency, "backend": args.backend,
                  "server_args": args.server_arg,
                  **counts, "by_setting": by_setting, "errors": errors[:10],
                  "rss_mb_after_warmup": warm[0], "rss_mb_end": warm[-1], "rss_mb_max": max(warm),
                  "rss_samples": rss, "running_after": health["running"], "waiting_after": health["waiting"]}
    finally:
        proc.terminate()
        proc.wait(60)
    report["exit_code"] = proc.returncode
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == report["garbled"] == report["garbled_seeded"] == report["hostile_wrong"] == 0 \
        else 1


if __name__ == "__main__":
    sys.exit(main())
