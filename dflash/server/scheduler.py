"""The engine thread: one thread owns the engine and drives dflash.loop.Batch; the asyncio side talks to it only
through queues.

Requests wait in a bounded FIFO; between cycles the thread admits waiting requests while the batch has free rows
(their prefill runs then), drops cancelled rows, and runs one cycle for every live row. Each request's increments go
back to its event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from ..errors import DFlashError
from ..loop import Batch, Generation, GenerationResult, Increment
from .metrics import Metrics

log = logging.getLogger("dflash.serve")


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One request's generation and the way back to its event loop."""

    gen: Generation
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    first_at: float | None = None
    last_at: float | None = None
    reused: int = 0  # prompt tokens the engine reused from its cache

    def send(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:
            pass  # the event loop is gone (shutdown): nobody is listening


class Scheduler:
    def __init__(self, engine, metrics: Metrics, max_batch: int = 16, max_queue: int = 64):
        self.engine, self.metrics = engine, metrics
        self.batch = Batch(engine)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.live: dict[int, Job] = {}
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)

    # ---- the asyncio side --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.wake:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.live)} requests running and {len(self.waiting)} waiting "
                                f"(--max-batch {self.max_batch}, --max-queue {self.max_queue})")
            self.waiting.append(job)
            self.metrics.queue_depth.set(len(self.waiting))
            self.wake.notify()

    def cancel(self, job: Job) -> None:
        with self.wake:
            job.cancelled = True
            self.wake.notify()

    def stop(self, timeout: float) -> bool:
        """Finish the running and waiting requests (at most `timeout` seconds), then end the thread."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def running(self) -> int:
        return len(self.live)

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.live and not self.stopping:
                    self.wake.wait()
                if self.stopping and not self.waiting and not self.live:
                    return
                joining = []
                while self.waiting and len(self.live) + len(joining) < self.max_batch:
                    joining.append(self.waiting.popleft())
                self.metrics.queue_depth.set(len(self.waiting))
            try:
                for job in joining:
                    self._join(job)
                for job in list(self.live.values()):
                    if job.cancelled:
                        self.batch.cancel(job.gen)
                self._collect()
                if self.live:
                    for gen, inc in self.batch.step():
                        self._deliver(self.live[id(gen)], inc)
                    self._collect()
            except Exception as e:  # an engine failure fails the running requests, not the server
                log.exception("engine failure")
                for job in self.live.values():
                    job.send("error", f"engine failure: {type(e).__name__}: {e}")
                self.live.clear()
                self.batch = Batch(self.engine)
                self.engine.reset()
            self.metrics.batch_size.set(len(self.batch))

    def _join(self, job: Job) -> None:
        if job.cancelled:
            job.send("done", None)
            return
        prompt = job.gen.prompt_ids
        try:
            inc = self.batch.join(job.gen)
        except Exception as e:  # this request's prefill failed: it alone fails, the running rows go on
            if not isinstance(e, DFlashError):
                log.exception("prefill failure")
            if not self.batch:
                self.engine.reset()  # a lone prefill may have left its caches half-written
            job.send("error", str(e) if isinstance(e, DFlashError) else f"prefill failure: {type(e).__name__}")
            return
        job.reused = self.engine.last_reused
        cache = getattr(self.engine, "prefix_cache", None)
        if cache is not None:
            self.metrics.prefix_cache_bytes.set(cache.bytes)
        self.metrics.prompt_tokens.inc(len(prompt))
        self.metrics.prefill_tokens.inc(len(prompt) - job.reused)
        self.live[id(job.gen)] = job
        self._deliver(job, inc)

    def _deliver(self, job: Job, inc: Increment) -> None:
        now = time.perf_counter()
        if inc.tokens:
            if job.first_at is None:
                job.first_at = now
                self.metrics.ttft.observe(now - job.arrived)
            elif job.last_at is not None:
                self.metrics.itl.observe((now - job.last_at) / len(inc.tokens))
            job.last_at = now
            self.metrics.generation_tokens.inc(len(inc.tokens))
        job.send("delta", inc)

    def _collect(self) -> None:
        for key, job in list(self.live.items()):
            result: GenerationResult | None = job.gen.result
            if result is None:
                continue
            del self.live[key]
            for n in result.acceptance_lengths:
                self.metrics.cycle(n)
            if result.acceptance_lengths:
                self.metrics.tau.observe(result.mean_acceptance_length)
            self.metrics.e2e.observe(time.perf_counter() - job.arrived)
            job.send("done", result)

