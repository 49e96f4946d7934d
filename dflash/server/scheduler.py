"""The engine thread: one thread owns the engine and drives dflash.core.loop.Batch; the asyncio side talks to it only
through queues. It is a one-worker executor, so the model can be loaded on it too (MLX streams belong to the thread
that created the arrays) and interpreter exit joins it (a daemon thread killed inside C++ aborts the process).

Requests wait in a bounded FIFO; the thread takes waiting requests while the batch has free rows, drops cancelled
rows, and runs one cycle for every live row. A request that joins running rows is prefilled into caches of its own,
`prefill_step` prompt tokens between two cycles (chunked prefill: the running streams never wait for a whole long
prompt), and merges into the batch once its prompt is in; a request that finds no running row is prefilled
into the engine's own caches, chunk by chunk as well (a request whose client has gone is dropped between two chunks).
Each request's increments go back to its event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core.admission import Admission
from ..core.errors import DFlashError
from ..core.loop import Batch, Generation, GenerationResult, Increment
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


def engine_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-engine")


class Scheduler:
    def __init__(self, engine, metrics: Metrics, max_batch: int = 16, max_queue: int = 64,
                 executor: ThreadPoolExecutor | None = None, prefill_step: int = 256):
        self.engine, self.metrics = engine, metrics
        self.batch = Batch(engine)
        self.max_batch, self.max_queue, self.prefill_step = max_batch, max_queue, prefill_step
        self.waiting: collections.deque[Job] = collections.deque()
        self.joining: collections.deque[tuple[Job, Admission]] = collections.deque()  # (job, its Admission)
        self.live: dict[int, Job] = {}
        self.accepted = 0  # submitted and not yet answered: running, about to run, or waiting
        self.wake = threading.Condition()
        self.stopping = False
        self.cutoff: float | None = None  # drain: past this, unfinished requests end with an error
        self.executor = executor or engine_executor()
        self.future: Future[None] | None = None

    # ---- the asyncio side --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.future = self.executor.submit(self._run)

    def submit(self, job: Job) -> None:
        with self.wake:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            # capacity = max_batch running + max_queue waiting; `accepted` also counts requests the engine thread
            # has not moved to a row yet (len(waiting) alone refused too early on an idle server)
            if self.accepted >= self.max_batch + self.max_queue:
                raise QueueFull(f"{self.accepted} requests running or waiting (--max-batch {self.max_batch} + "
                                f"--max-queue {self.max_queue})")
            self.accepted += 1
            self.waiting.append(job)
            self.metrics.queue_depth.set(len(self.waiting))
            self.wake.notify()

    def cancel(self, job: Job) -> None:
        with self.wake:
            job.cancelled = True
            self.wake.notify()

    def drain(self, timeout: float) -> None:
        """Take no new requests; those running or waiting finish, or end with an error event after `timeout` s."""
        with self.wake:
            if not self.stopping:
                self.stopping, self.cutoff = True, time.monotonic() + timeout
            self.wake.notify()

    def stop(self, timeout: float) -> bool:
        """drain(timeout), then wait for the engine thread to end (a little longer: it answers the cut requests)."""
        self.drain(timeout)
        if self.future is None:
            return True
        assert self.cutoff is not None  # (drain set it)
        try:
            self.future.result(max(0.0, self.cutoff - time.monotonic()) + 5)
        except Exception:  # noqa: BLE001  (a timeout; _run itself never raises)
            return False
        self.executor.shutdown(wait=False)
        return True

    @property
    def running(self) -> int:
        return len(self.live)

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.live and not self.joining and not self.stopping:
                    self.wake.wait()
                if self.stopping and not self.waiting and not self.live and not self.joining:
                    return
                if self.cutoff is not None and time.monotonic() >= self.cutoff:
                    self._cut()
                    return
                taken: list[Job] = []
                while self.waiting and len(self.live) + len(self.joining) + len(taken) < self.max_batch:
                    taken.append(self.waiting.popleft())
                self.metrics.queue_depth.set(len(self.waiting))
            try:
                for job in taken:
                    self._begin(job)
                self._prefill()
                for job in list(self.live.values()):
                    if job.cancelled:
                        self.batch.cancel(job.gen)
                self._collect()
                if self.live:
                    self.metrics.step_rows.observe(len(self.batch))
                    for gen, inc in self.batch.step():  # a row whose step fails leaves alone (Batch._isolate)
                        self._deliver(self.live[id(gen)], inc)
                    self._collect()
            except Exception as e:  # a failure no row explains fails the running requests, not the server
                log.exception("engine failure")
                for job in self.live.values():
                    self._answer(job, "error", f"engine failure: {type(e).__name__}: {e}")
                self.live.clear()
                self.batch = Batch(self.engine)
                self.engine.reset()
            self.metrics.batch_size.set(len(self.batch))

    def _cut(self) -> None:
        """The drain timeout passed: every unfinished request gets an error event now (streams end with it and
        [DONE]), and the rows are freed."""
        message = "server shutting down: the request did not finish within --drain-timeout"
        for job in list(self.live.values()) + [job for job, _ in self.joining] + list(self.waiting):
            self._answer(job, "error", message)
        for gen in self.batch.generations:
            self.batch.cancel(gen)
        self.live.clear()
        self.joining.clear()
        self.waiting.clear()
        self.metrics.batch_size.set(0)

    def _answer(self, job: Job, kind: str, payload) -> None:
        """A job's last event: it leaves the admission count."""
        with self.wake:
            self.accepted -= 1
        job.send(kind, payload)

    def _begin(self, job: Job) -> None:
        """A request leaves the queue and joins the admissions that _prefill advances chunk by chunk (into the
        engine's own caches when nothing else runs or joins: the previous sequence's prefix is reused)."""
        if job.cancelled:
            self._answer(job, "done", None)
            return
        alone = not self.batch and not self.joining
        try:
            self.joining.append((job, self.batch.begin(job.gen, self.prefill_step, alone=alone)))
        except Exception as e:  # noqa: BLE001  (its own failure: a prompt that cannot fit, say)
            self._fail_prefill(job, e)

    def _prefill(self) -> None:
        """Joining prompts, oldest first, chunk by chunk up to prefill_step prompt tokens per cycle of the running
        rows (all of them while no row runs: nobody waits); a finished one joins the batch. Whether a request is
        still wanted is checked before every chunk, so a client that has gone costs at most one chunk; a failing
        admission fails alone: its caches were its own (or an idle engine's), so the running rows go on."""
        spent = 0
        while self.joining and (spent < self.prefill_step or not self.batch):
            job, admission = self.joining[0]
            if job.cancelled:
                self.joining.popleft()
                self._answer(job, "done", None)
                continue
            try:
                done = admission.advance()
            except Exception as e:  # noqa: BLE001
                self.joining.popleft()
                if not self.batch:
                    self.engine.reset()  # a prefill in the idle engine's own caches may have left them half-written
                self._fail_prefill(job, e)
                continue
            spent += min(self.prefill_step, admission.prompt_tokens)
            if done:
                self.joining.popleft()
                self._join(job, admission)

    def _fail_prefill(self, job: Job, e: Exception) -> None:
        if not isinstance(e, DFlashError):
            log.exception("prefill failure")
        self._answer(job, "error", str(e) if isinstance(e, DFlashError) else f"prefill failure: {type(e).__name__}")

    def _join(self, job: Job, admission=None) -> None:
        prompt = job.gen.prompt_ids
        try:
            inc = self.batch.join(job.gen, admission)
        except Exception as e:  # this request's prefill failed: it alone fails, the running rows go on
            if not self.batch:
                self.engine.reset()  # a lone prefill may have left its caches half-written
            self._fail_prefill(job, e)
            return
        job.reused = self.engine.last_reused
        if self.engine.prefix_cache is not None:
            self.metrics.prefix_cache_bytes.set(self.engine.prefix_cache.bytes)
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
            if result.error:
                log.warning("request failed alone: %s", result.error)
                self._answer(job, "error", f"engine failure: {result.error}")
                continue
            for n in result.acceptance_lengths:
                self.metrics.cycle(n)
            if result.acceptance_lengths:
                self.metrics.tau.labels(accept_rule=result.accept_rule).observe(result.mean_acceptance_length)
            self.metrics.e2e.observe(time.perf_counter() - job.arrived)
            self._answer(job, "done", result)

