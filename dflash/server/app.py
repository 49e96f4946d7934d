"""The HTTP layer: FastAPI routes that turn OpenAI requests into dflash.core.loop.Generations for the engine thread
(dflash/server/scheduler.py) and its increments back into OpenAI responses or server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..core.errors import DFlashError
from . import render
from .intake import Intake, RequestState, parse_body
from .metrics import Metrics
from .middleware import AccessLog
from .parsing import Delta
from .protocol import ApiError, error_body
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("dflash.serve")


# Rendering a chat template and tokenising run on a worker thread; past this, the request is refused (the thread
# still finishes its work, but the event loop and the other requests never wait for it).
PREPARE_TIMEOUT = 10.0
# The drain ends the responses still running at --drain-timeout, on the event loop; they have this long to write
# their last event. The engine thread's own cut (which only frees its rows) comes after it, and at exit the engine
# thread gets ENGINE_GRACE to leave a cycle it is inside, after which the process exits without it.
CUT_GRACE = 0.5
ENGINE_GRACE = 1.0
DRAIN_POLL = 0.05
DRAIN_CUT = "server shutting down: the request did not finish within --drain-timeout"


class Server:
    def __init__(self, pipe, *, model_name: str, aliases=(), max_batch: int = 16, max_queue: int = 64,
                 api_key: str | None = None, max_request_bytes: int = 1 << 20, drain_timeout: float = 30.0,
                 prefix_cache_mb: float = 0, chat_template: str | None = None, sampling_defaults: dict | None = None,
                 body_timeout: float = 30.0, metrics_public: bool = False, executor=None, prefill_step: int = 256):
        self.pipe, self.engine, self.tokenizer = pipe, pipe.engine, pipe.tokenizer
        if not self.engine.capabilities.batches:
            max_batch = 1  # one row at a time: requests queue in FIFO order
        self.model_name, self.names = model_name, {model_name, *aliases}
        self.api_key, self.max_request_bytes, self.drain_timeout = api_key, max_request_bytes, drain_timeout
        self.body_timeout, self.metrics_public = body_timeout, metrics_public
        self.intake = Intake(pipe, self.names, model_name, chat_template, sampling_defaults)
        if prefix_cache_mb > 0:
            try:
                self.engine.enable_prefix_cache(int(prefix_cache_mb * 2**20))
            except DFlashError as e:
                log.warning("--prefix-cache-mb: off, rows of this backend or target are not kept apart (%s); the "
                            "last sequence is still reused when the next request runs alone", e)
        self.metrics = Metrics(self.engine.block_size)
        self.scheduler = Scheduler(self.engine, self.metrics, max_batch=max_batch, max_queue=max_queue,
                                   executor=executor, prefill_step=prefill_step)
        self.started = time.time()
        self.jobs: dict[int, Job] = {}  # id -> job: submitted, its response not yet ended (the event loop's side)
        self.draining = False

    # ---- the app ---------------------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.scheduler.start()
            yield
            self.scheduler.drain(0)  # (after a drain, a no-op: every request has been answered already)
            assert self.scheduler.future is not None  # (started above)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.scheduler.future)), ENGINE_GRACE)
            except asyncio.TimeoutError:
                log.warning("drain: the engine thread is still inside a cycle; exiting without waiting for it")
            else:
                self.scheduler.stop(0)  # (returns at once: the thread has ended; its executor shuts down)

        app = FastAPI(title="dflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(AccessLog, api_key=self.api_key, max_request_bytes=self.max_request_bytes,
                           body_timeout=self.body_timeout, metrics_public=self.metrics_public, metrics=self.metrics,
                           draining=lambda: self.draining)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError):
            request.state.error = e.message  # (counted by the middleware, as every status >= 400)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, e: HTTPException):
            request.state.error = str(e.detail)
            return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", "invalid_request_error",
                                           None, str(e.status_code)), status_code=e.status_code)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, e: Exception):
            log.exception("internal error")
            request.state.error = f"{type(e).__name__}: {e}"
            return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

        @app.get("/health")
        async def health(request: Request):
            s = self.scheduler
            body = {"status": "draining" if self.draining else "ok", "model": self.model_name, "running": s.running,
                    "prefilling": len(s.joining), "waiting": len(s.waiting), "max_batch": s.max_batch,
                    "max_queue": s.max_queue, "backend": self.pipe.backend_name}
            if not self.draining:
                return body
            request.state.counted = True  # (unready is not a refused request)
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self.model_card(self.model_name)]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            if model not in self.names:
                raise ApiError(404, f"model: {model!r} is not served here (serving {self.model_name!r})", "model",
                               "model_not_found")
            return self.model_card(model)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.generate(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.generate(request, chat=False)

        return app

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(self.started), "owned_by": "dflash"}

    async def drain(self, started: float, abandoned=lambda: False) -> None:
        """SIGTERM / SIGINT at time.monotonic() `started`: /health turns unready (503) and new requests get 503 at
        once; running ones go on until they finish or --drain-timeout has passed, when each ends here, on the event
        loop, whatever the engine thread is doing: a stream with an error event and [DONE], a whole response with
        503. Returns when no response is left running (an idle server: at once) or `abandoned()` (a second SIGINT)."""
        self.draining = True
        deadline = started + self.drain_timeout
        # the engine's own cut only backs this one up (it frees rows whose response is already gone)
        self.scheduler.drain(max(0.0, deadline - time.monotonic()) + CUT_GRACE)
        log.info("drain: %d request(s) running; new ones get 503 (at most --drain-timeout %g s)", len(self.jobs),
                 self.drain_timeout)
        await _until(lambda: not self.jobs or abandoned(), deadline)
        if self.jobs:
            log.warning("drain: %d request(s) unfinished after --drain-timeout %g s end with an error",
                        len(self.jobs), self.drain_timeout)
            for job in self.jobs.values():
                self.scheduler.cancel(job)
                job.events.put_nowait(("shutdown", DRAIN_CUT))  # read next: nothing waits for the engine
            await _until(lambda: not self.jobs or abandoned(), time.monotonic() + CUT_GRACE)

    # ---- one request -----------------------------------------------------------------------------------------------
    async def generate(self, request: Request, chat: bool):
        raw = await request.body()  # (read, size- and time-bounded, by the middleware)
        req = parse_body(raw, chat)
        try:  # the chat template and the tokenizer run off the event loop
            gen, ctx = await asyncio.wait_for(asyncio.to_thread(self.intake.prepare, req, chat), PREPARE_TIMEOUT)
        except asyncio.TimeoutError:
            raise ApiError(400, f"messages: rendering and tokenising the prompt took more than {PREPARE_TIMEOUT:g} s",
                           "messages" if chat else "prompt") from None
        job = Job(gen, asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}; retry later", None, "server_busy", "server_error",
                           headers={"Retry-After": "1"}) from None
        self.jobs[id(job)] = job
        request.state.access = ctx.access
        if req.stream:
            return StreamingResponse(self.stream(job, ctx, req.include_usage()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.complete(job, ctx, request)

    # ---- responses -------------------------------------------------------------------------------------------------
    async def complete(self, job: Job, ctx: RequestState, request: Request):
        watcher = asyncio.create_task(_until_disconnect(request))
        total, texts, lp = Delta(), [], render.Logprobs(self.tokenizer, ctx.chat)
        entries = []
        try:
            while True:
                getter = asyncio.ensure_future(job.events.get())
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    self.scheduler.cancel(job)
                    self._outcome(ctx, "cancelled")
                    return Response(status_code=499)
                kind, payload = getter.result()
                if kind == "delta":
                    self._merge(total, ctx, payload.text)
                    texts.append(payload.text)
                    entries += lp.add(payload) if payload.logprobs is not None else []
                elif kind in ("error", "shutdown"):
                    self._outcome(ctx, "error")
                    request.state.counted = True
                    if kind == "shutdown":
                        return JSONResponse(error_body(payload, "server_error", None, "server_shutting_down"),
                                            status_code=503, headers={"Retry-After": "1", "Connection": "close"})
                    return JSONResponse(error_body(payload, "server_error"), status_code=500)
                else:
                    result = payload
                    self._merge(total, ctx, "", final=True)
                    break
        finally:
            watcher.cancel()
            self.jobs.pop(id(job), None)
        stats = self._finish(ctx, result, job.reused)
        logprobs = lp.render(entries) if job.gen.logprobs is not None else None
        if ctx.chat:
            body = render.chat_response(ctx.id, self.model_name, total, result, logprobs, stats)
        else:
            body = render.completion_response(ctx.id, self.model_name, "".join(texts), result, logprobs, stats)
        return JSONResponse(body)

    async def stream(self, job: Job, ctx: RequestState, include_usage: bool):
        rid, model, chat = ctx.id, self.model_name, ctx.chat
        lp, finished = render.Logprobs(self.tokenizer, chat), False
        try:
            if chat:
                yield render.sse(render.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    entries = lp.add(payload) if payload.logprobs is not None else None
                    logprobs = lp.render(entries) if entries else None
                    if chat:
                        delta = render.chat_delta(ctx.parser.feed(payload.text))
                        if delta or logprobs:
                            yield render.sse(render.chat_chunk(rid, model, delta, None, logprobs))
                    elif payload.text or logprobs:
                        yield render.sse(render.completion_chunk(rid, model, payload.text, None, logprobs))
                elif kind in ("error", "shutdown"):
                    finished = True
                    self._outcome(ctx, "error")
                    code = "server_shutting_down" if kind == "shutdown" else None
                    yield render.sse(error_body(payload, "server_error", None, code))
                    yield render.SSE_DONE
                    return
                else:
                    break
            result, finished = payload, True
            stats = self._finish(ctx, result, job.reused)
            if chat:
                rest = ctx.parser.feed("", final=True)
                tools = bool(ctx.parser.calls)
                chunk = render.chat_chunk(rid, model, render.chat_delta(rest), render.finish_reason(result, tools))
            else:
                chunk = render.completion_chunk(rid, model, "", result.finish_reason)
            chunk["dflash"] = stats
            yield render.sse(chunk)
            if include_usage:
                yield render.sse({"id": rid, "object": chunk["object"], "created": chunk["created"], "model": model,
                                  "choices": [], "usage": render.usage(result), "dflash": stats})
            yield render.SSE_DONE
        finally:
            self.jobs.pop(id(job), None)
            if not finished:  # the client went away: free the row
                self.scheduler.cancel(job)
                self._outcome(ctx, "cancelled")

    def _merge(self, total: Delta, ctx: RequestState, text: str, final: bool = False) -> None:
        if not ctx.chat:
            return
        d = ctx.parser.feed(text, final=final)
        total.reasoning += d.reasoning
        total.content += d.content
        total.tool_calls += d.tool_calls

    def _finish(self, ctx: RequestState, result, reused: int) -> dict:
        self._outcome(ctx, "ok")
        ctx.access.update(completion_tokens=result.generation_tokens, finish=result.finish_reason,
                             tau=round(result.mean_acceptance_length, 2), accept=result.accept_rule)
        return render.dflash_stats(result, reused, ctx.max_tokens, ctx.capped)

    def _outcome(self, ctx: RequestState, outcome: str) -> None:
        ctx.access["outcome"] = outcome
        self.metrics.requests.labels(endpoint=ctx.endpoint, outcome=outcome).inc()


async def _until(done, deadline: float) -> None:
    """Wait until done() or time.monotonic() passes `deadline` (polled: the drain runs once per process)."""
    while not done() and (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(DRAIN_POLL, left))


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
