"""Answer training prompts through any OpenAI-compatible server (`python -m dflash.serve`, vLLM, SGLang, ...),
resumably, into the rows the in-process path writes (backends/torch/regeneration.py).

Rows go to the server's /v1/chat/completions, `concurrency` at a time; each answer is appended (flushed, fsynced)
as soon as it comes back, so a killed run loses only the requests in flight, and rerunning the command skips the
ids already written. A thinking model's `reasoning_content` is written back inside `<think>...</think>` before the
answer, as the target wrote it. `answer_tokens` is the server's completion_tokens without the EOS of an answer that
stopped (the in-process count). The server's 503 (busy) is retried; an unreachable server stops the run.
"""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .core.training.answers import AnswerFile, input_rows, recover_output, write_stats
from .core.training.datasets import prompt_messages, row_messages
from .core.errors import DFlashError
from .core.io import check_output_dir


class Endpoint:
    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0):
        import httpx  # the serve extra

        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout)
        self.errors = (httpx.TransportError,)
        self.model = model or self.first_model()

    def first_model(self) -> str:
        try:
            r = self.http.get(self.url + "/v1/models")
        except self.errors as e:
            raise DFlashError(f"--endpoint: cannot reach {self.url} ({type(e).__name__}: {e})") from None
        if r.status_code != 200 or not r.json().get("data"):
            raise DFlashError(f"--endpoint: {self.url}/v1/models answered {r.status_code}; pass --model NAME")
        return r.json()["data"][0]["id"]

    def chat(self, body: dict, attempts: int = 30) -> tuple[int, dict]:
        """(status, body) of one chat completion; a busy server (503) and dropped connections are retried."""
        for attempt in range(attempts):
            try:
                r = self.http.post(self.url + "/v1/chat/completions", json=dict(body, model=self.model))
            except self.errors as e:
                if attempt + 1 == attempts:
                    raise DFlashError(f"--endpoint: cannot reach {self.url} ({type(e).__name__}: {e})") from None
                time.sleep(min(1.0 * (attempt + 1), 5.0))
                continue
            if r.status_code == 503 and attempt + 1 < attempts:
                time.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            try:
                return r.status_code, r.json()
            except ValueError:
                return r.status_code, {"error": {"message": r.text[:200]}}
        raise AssertionError("unreachable")


def answer_row(rid: str, messages: list[dict], status: int, body: dict, thinking: bool) -> dict:
    base = {"id": rid, "thinking": thinking}
    if status != 200:
        message = (body.get("error") or {}).get("message", f"HTTP {status}")
        too_long = (body.get("error") or {}).get("code") == "context_length_exceeded"
        return dict(base, status="skipped" if too_long else "failed", error=f"HTTP {status}: {message}")
    choice, usage = body["choices"][0], body.get("usage") or {}
    msg = choice.get("message") or {}
    text = msg.get("content") or ""
    if msg.get("reasoning_content"):
        text = f"<think>{msg['reasoning_content']}</think>\n\n{text}"
    finish = "stop" if choice.get("finish_reason") in ("stop", "tool_calls") else "length"
    answer_tokens = usage.get("completion_tokens", 0) - (1 if finish == "stop" else 0)
    return dict(base, messages=messages + [{"role": "assistant", "content": text}],
                thinking=thinking or "<think>" in text, status="ok", finish_reason=finish,
                prompt_tokens=usage.get("prompt_tokens", 0), answer_tokens=max(answer_tokens, 0))


def regenerate_remote(endpoint: str, input_path, output_path, *, model: str | None = None,
                      api_key: str | None = None, concurrency: int = 8, temperature: float = 0.0,
                      top_p: float = 1.0, max_new_tokens: int = 2048, enable_thinking: bool | None = None,
                      seed: int = 0, progress: bool = True, log=print) -> dict:
    if concurrency < 1:
        raise DFlashError(f"--concurrency: got {concurrency}, expected >= 1")
    if max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens: got {max_new_tokens}, expected >= 1")
    output_path = Path(output_path)
    if output_path.is_dir():
        raise DFlashError(f"--output: {output_path} is a directory, expected a JSONL file")
    check_output_dir(output_path.parent, "--output", output_path)
    done = recover_output(output_path)
    rows = input_rows(input_path)
    todo = [(i, rid, row) for i, rid, row in rows if rid not in done]
    log(f"regenerate: {len(rows)} input rows, {len(rows) - len(todo)} already done, {len(todo)} to answer "
        f"through {endpoint}")
    server = Endpoint(endpoint, api_key, model) if todo else None
    lock = threading.Lock()
    thinking = bool(enable_thinking)
    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="regenerate", unit="answer", dynamic_ncols=True)
    output = AnswerFile(output_path)

    def write(row: dict) -> None:
        with lock:
            output.append(row)
            if bar is not None:
                bar.update(1)

    def one(item) -> None:
        i, rid, row = item
        base = {"id": rid, "thinking": thinking, "status": "skipped"}
        try:
            messages = prompt_messages(row_messages(row, f"{input_path}:{i + 1}"))
        except DFlashError as e:
            return write(dict(base, error=str(e)))
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            return write(dict(base, error="no user turn to answer"))
        body = {"messages": messages, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        if temperature > 0:
            body["seed"] = seed + zlib.crc32(rid.encode())
        if enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        assert server is not None  # (made when there is something to answer)
        status, answer = server.chat(body)
        write(answer_row(rid, messages, status, answer, thinking))

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(one, item) for item in todo]:
                f.result()  # an unreachable server stops the run here (the finished rows are kept)
    finally:
        output.close()
        if bar is not None:
            bar.close()
    output.ensure()
    return write_stats(output_path, len(rows), log)
