"""dflash.server.scheduler over a scripted engine: a prompt on an idle server is prefilled chunk by chunk too, and a
request whose client has gone is dropped between two chunks (its whole prompt was once prefilled first)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi")
from test_server_app import EOS, CharTokenizer, ScriptedEngine  # noqa: E402

from dflash.core.loop import Generation  # noqa: E402
from dflash.server.metrics import Metrics  # noqa: E402
from dflash.server.scheduler import Job, Scheduler  # noqa: E402

CHUNK = 8


class SlowPrefill(ScriptedEngine):
    """Each prefill chunk takes 10 ms; its first chunk sets `started`. A whole prefill (prefill(), as join() without
    an admission runs it) runs every chunk at once."""

    def __init__(self, script):
        super().__init__(script)
        self.started = threading.Event()

    def begin_prefill(self, prompt, sampling=None, chunk=None):
        admission = super().begin_prefill(prompt, sampling, CHUNK)
        advance = admission.advance

        def slow():
            self.started.set()
            time.sleep(0.01)
            return advance()
        admission.advance = slow
        return admission

    def prefill(self, prompts):
        admission = self.begin_prefill(prompts[0])
        while not admission.advance():
            pass
        self.rows = [0]
        return [admission.first]


def test_a_request_whose_client_has_gone_stops_its_prefill_within_a_chunk():
    tok = CharTokenizer()
    engine = SlowPrefill(tok.encode("an answer") + [EOS])

    async def main():
        scheduler = Scheduler(engine, Metrics(engine.block_size), prefill_step=CHUNK)
        scheduler.start()
        prompt = tok.encode("x" * 100 * CHUNK)  # 100 chunks: a second
        job = Job(Generation(engine, prompt, tokenizer=tok, max_new_tokens=4), asyncio.get_running_loop())
        scheduler.submit(job)
        assert await asyncio.to_thread(engine.started.wait, 10)
        scheduler.cancel(job)
        kind, result = await asyncio.wait_for(job.events.get(), 10)
        chunks = engine.chunks
        after = Job(Generation(engine, tok.encode("q"), tokenizer=tok, max_new_tokens=4), asyncio.get_running_loop())
        scheduler.submit(after)
        events = [await asyncio.wait_for(after.events.get(), 10)]
        while events[-1][0] == "delta":
            events.append(await asyncio.wait_for(after.events.get(), 10))
        scheduler.stop(1)
        return kind, result, chunks, events

    kind, result, chunks, events = asyncio.run(main())
    assert (kind, result) == ("done", None)  # dropped before its first token
    assert chunks <= 3, chunks  # (the whole prompt's 100 chunks ran before the cancellation was seen)
    assert events[-1][0] == "done" and "".join(p.text for k, p in events if k == "delta") == "an a"
