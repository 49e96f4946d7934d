"""The HTTP layer: FastAPI routes that turn OpenAI requests into dflash.loop.Generations for the engine thread
(dflash/server/scheduler.py) and its increments back into OpenAI responses or server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import uvicorn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..engine import check_fits
from ..errors import DFlashError
from ..loop import Generation
from . import render
from .metrics import Metrics
from .middleware import AccessLog
from .parsing import THINK_CLOSE, THINK_OPEN, Delta, OutputParser, starts_in_reasoning
from .protocol import MAX_TOP_LOGPROBS, ApiError, ChatRequest, CompletionRequest, chat_messages, error_body
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("dflash.serve")


def _field_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"body: not valid JSON ({err['msg']})", None, "invalid_json")
    loc = _location(err["loc"])
    got = err.get("input")
    shown = "" if err["type"] == "missing" else f" (got {str(got)[:60]!r})"
    return ApiError(400, f"{loc}: {err['msg']}{shown}", loc, "invalid_type" if "type" in err["type"] else None)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _location(loc) -> str:
    """A field path as a client spells it (messages[0].role), without pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not ("[" in part or "-" in part or part in _TYPE_TAGS):
            out += f".{part}" if out else part
    return out or "body"


def _sampling_error(e: DFlashError) -> ApiError:
    # SamplingParams speaks in CLI flags (--top-p); a client sent fields (top_p)
    flag, _, rest = str(e).partition(":")
    field = flag.strip().lstrip("-").replace("-", "_")
    return ApiError(400, f"{field}:{rest}", field)


class Server:
    def __init__(self, pipe, *, model_name: str, aliases=(), max_batch: int = 16, max_queue: int = 64,
                 api_key: str | None = None, max_request_bytes: int = 1 << 20, drain_timeout: float = 30.0,
                 prefix_cache_mb: float = 0):
        self.pipe, self.engine, self.tokenizer = pipe, pipe.backend, pipe.tokenizer
        if pipe.backend_name != "torch":
            max_batch = 1  # MLX runs one row: requests queue in FIFO order
        self.model_name, self.names = model_name, {model_name, *aliases}
        self.api_key, self.max_request_bytes, self.drain_timeout = api_key, max_request_bytes, drain_timeout
        if prefix_cache_mb > 0:
            try:
                self.engine.enable_prefix_cache(int(prefix_cache_mb * 2**20))
            except DFlashError as e:
                log.warning("--prefix-cache-mb: off, rows of this backend or target are not kept apart (%s); the "
                            "last sequence is still reused when the next request runs alone", e)
        self.metrics = Metrics(self.engine.block_size)
        self.scheduler = Scheduler(self.engine, self.metrics, max_batch=max_batch, max_queue=max_queue)
        vocab = self.tokenizer.get_vocab()
        self.reasoning = THINK_OPEN in vocab and THINK_CLOSE in vocab
        self.started = time.time()

    # ---- the app ---------------------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.scheduler.start()
            yield
            if not self.scheduler.stop(self.drain_timeout):
                log.warning("drain: requests still running after %.0f s; exiting anyway", self.drain_timeout)

        app = FastAPI(title="dflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(AccessLog, api_key=self.api_key, max_request_bytes=self.max_request_bytes)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError):
            request.state.error = e.message
            self.metrics.requests.labels(endpoint=request.url.path, outcome="busy" if e.status == 503 else
                                         "rejected").inc()
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
        async def health():
            s = self.scheduler
            return {"status": "ok", "model": self.model_name, "running": s.running, "waiting": len(s.waiting),
                    "max_batch": s.max_batch, "max_queue": s.max_queue, "backend": self.pipe.backend_name}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                "created": int(self.started), "owned_by": "dflash"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.generate(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.generate(request, chat=False)

        return app

    # ---- one request -----------------------------------------------------------------------------------------------
    async def generate(self, request: Request, chat: bool):
        raw = await request.body()
        if len(raw) > self.max_request_bytes:
            raise ApiError(413, f"body: {len(raw)} bytes exceed --max-request-bytes {self.max_request_bytes}",
                           None, "request_too_large")
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate_json(raw)
        except ValidationError as e:
            raise _field_error(e) from None
        gen, ctx = self.prepare(req, chat)
        job = Job(gen, asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}; retry later", None, "server_busy", "server_error",
                           headers={"Retry-After": "1"}) from None
        request.state.access = ctx["access"]
        if req.stream:
            return StreamingResponse(self.stream(job, ctx, req.include_usage()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.complete(job, ctx, request)

    def prepare(self, req, chat: bool) -> tuple[Generation, dict]:
        if req.model is not None and req.model not in self.names:
            raise ApiError(404, f"model: {req.model!r} is not served here (serving {self.model_name!r})", "model",
                           "model_not_found")
        if req.n != 1:
            raise ApiError(400, f"n: got {req.n}, only n=1 is supported (send n requests instead)", "n")
        try:
            sampling = req.sampling().validate()
        except DFlashError as e:
            raise _sampling_error(e) from None
        if req.seed is not None and req.seed >= 2**63:
            raise ApiError(400, f"seed: got {req.seed}, expected 0 .. 2**63 - 1", "seed")
        k = req.logprobs_k()
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            field = "top_logprobs" if chat else "logprobs"
            raise ApiError(400, f"{field}: got {k}, expected 0 .. {MAX_TOP_LOGPROBS}", field)
        in_reasoning = False
        if chat:
            ids, prompt_text = self.chat_prompt(req)
            in_reasoning = self.reasoning and starts_in_reasoning(prompt_text)
        else:
            ids = self.completion_prompt(req)
        try:
            check_fits(ids, self.engine.max_context)
        except DFlashError as e:
            raise ApiError(400, f"messages: {e}" if chat else str(e), "messages" if chat else "prompt",
                           "context_length_exceeded") from None
        limit, capped = self.token_limit(req, len(ids))
        stops = req.stop_strings()
        gen = Generation(self.engine, ids, tokenizer=self.tokenizer, max_new_tokens=limit, sampling=sampling,
                         eos_token_ids=self.pipe.eos_token_ids, stop_strings=stops, logprobs=k)
        parser = OutputParser(reasoning=self.reasoning and chat, in_reasoning=in_reasoning,
                              tools=chat and bool(getattr(req, "tools", None)))
        rid = render.new_id("chatcmpl" if chat else "cmpl")
        access = {"id": rid, "prompt_tokens": len(ids), "max_tokens": limit}
        return gen, {"chat": chat, "id": rid, "parser": parser, "max_tokens": limit, "capped": capped,
                     "access": access, "endpoint": "/v1/chat/completions" if chat else "/v1/completions"}

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], str]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        messages = chat_messages(req.messages)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # jinja2 errors and bad message shapes: the client's input
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ApiError(400, f"messages: the chat template refused them ({first})", "messages") from None
        return tok(text, add_special_tokens=False)["input_ids"], text

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if req.echo:
            raise ApiError(400, "echo: not supported", "echo")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: a list of {len(prompt)} prompts; send one request per prompt",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        else:
            vocab = self.engine.info.vocab_size
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               "prompt")
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "prompt: empty; expected text or token ids", "prompt")
        return ids

    def token_limit(self, req, prompt_tokens: int) -> tuple[int, bool]:
        """The request's token limit, capped to what the target's context has left (said in the dflash object)."""
        limit = req.token_limit()
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        if limit is not None and limit < 1:
            raise ApiError(400, f"{field}: got {limit}, expected >= 1", field)
        room = self.engine.max_context - prompt_tokens if self.engine.max_context else None
        if limit is None:
            if room is None:
                raise ApiError(400, f"{field}: required (the target declares no context length)", field)
            return room, False
        if room is not None and limit > room:
            return room, True
        return limit, False

    # ---- responses -------------------------------------------------------------------------------------------------
    async def complete(self, job: Job, ctx: dict, request: Request):
        watcher = asyncio.create_task(_until_disconnect(request))
        total, texts, lp = Delta(), [], render.Logprobs(self.tokenizer, ctx["chat"])
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
                elif kind == "error":
                    self._outcome(ctx, "error")
                    return JSONResponse(error_body(payload, "server_error"), status_code=500)
                else:
                    result = payload
                    self._merge(total, ctx, "", final=True)
                    break
        finally:
            watcher.cancel()
        stats = self._finish(ctx, result, job.reused)
        logprobs = lp.render(entries) if job.gen.logprobs is not None else None
        if ctx["chat"]:
            body = render.chat_response(ctx["id"], self.model_name, total, result, logprobs, stats)
        else:
            body = render.completion_response(ctx["id"], self.model_name, "".join(texts), result, logprobs, stats)
        return JSONResponse(body)

    async def stream(self, job: Job, ctx: dict, include_usage: bool):
        rid, model, chat = ctx["id"], self.model_name, ctx["chat"]
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
                        delta = render.chat_delta(ctx["parser"].feed(payload.text))
                        if delta or logprobs:
                            yield render.sse(render.chat_chunk(rid, model, delta, None, logprobs))
                    elif payload.text or logprobs:
                        yield render.sse(render.completion_chunk(rid, model, payload.text, None, logprobs))
                elif kind == "error":
                    finished = True
                    self._outcome(ctx, "error")
                    yield render.sse(error_body(payload, "server_error"))
                    yield render.SSE_DONE
                    return
                else:
                    break
            result, finished = payload, True
            stats = self._finish(ctx, result, job.reused)
            if chat:
                rest = ctx["parser"].feed("", final=True)
                tools = bool(ctx["parser"].calls)
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
            if not finished:  # the client went away (or the server is stopping): free the row
                self.scheduler.cancel(job)
                self._outcome(ctx, "cancelled")

    def _merge(self, total: Delta, ctx: dict, text: str, final: bool = False) -> None:
        if not ctx["chat"]:
            return
        d = ctx["parser"].feed(text, final=final)
        total.reasoning += d.reasoning
        total.content += d.content
        total.tool_calls += d.tool_calls

    def _finish(self, ctx: dict, result, reused: int) -> dict:
        self._outcome(ctx, "ok")
        ctx["access"].update(completion_tokens=result.generation_tokens, finish=result.finish_reason,
                             tau=round(result.mean_acceptance_length, 2))
        return render.dflash_stats(result, reused, ctx["max_tokens"], ctx["capped"])

    def _outcome(self, ctx: dict, outcome: str) -> None:
        ctx["access"]["outcome"] = outcome
        self.metrics.requests.labels(endpoint=ctx["endpoint"], outcome=outcome).inc()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Uvicorn(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            # uvicorn re-raises a captured signal after its graceful shutdown; a drained SIGTERM is a clean exit
            self._captured_signals.remove(sig)


def run(server: Server, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM; running requests drain for at most server.drain_timeout seconds."""
    config = uvicorn.Config(server.app(), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=server.drain_timeout, log_config=None)
    _Uvicorn(config).run()
