"""Pure ASGI middleware (it passes http.disconnect through, which streaming needs): the API key, new API requests
refused while the server drains, the request body read under a size limit and a time limit, one access log line per
request, and the count of every refused request.

The body is read here, before any route runs: bytes are counted as they arrive (a chunked body has no
Content-Length to check first), so a body over --max-request-bytes is refused with 413 as soon as the limit passes,
never buffered whole; a client that stops sending gets 408 after --body-timeout seconds; one that disconnects
mid-body is one log line. The route then reads the buffered body from a replayed `receive`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from .protocol import error_body

access_log = logging.getLogger("dflash.serve.access")
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str | None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class _Gone(Exception):
    """The client disconnected before its body was read."""


class AccessLog:
    def __init__(self, app, api_key: str | None = None, max_request_bytes: int = 1 << 20,
                 body_timeout: float = 30.0, metrics_public: bool = False, metrics=None, draining=lambda: False):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.body_timeout, self.metrics_public, self.metrics = body_timeout, metrics_public, metrics
        self.draining = draining  # () -> bool: SIGTERM has come (Server.drain)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]
        state = scope.setdefault("state", {})
        raw_headers = scope.get("headers", [])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            try:
                self.check_key(scope["path"], headers, raw_headers)
                if self.draining() and scope["path"].startswith("/v1/"):
                    raise _Refused(503, "server shutting down: no new requests (retry, on another replica)",
                                   "server_shutting_down", {"retry-after": "1"})
                if scope["method"] in ("POST", "PUT", "PATCH"):
                    receive = await self.read_body(receive, headers)
            except _Refused as e:
                state["error"] = e.message
                kind = {401: "authentication_error", 503: "server_error"}.get(e.status, "invalid_request_error")
                await _json(send, e.status, error_body(e.message, kind, None, e.code), e.headers)
                status[0] = e.status
                return
            except _Gone:
                state["error"] = "client disconnected before sending its whole body"
                status[0] = 499
                return
            try:
                await self.app(scope, receive, logged_send)
            except Exception as e:  # answered 500 by Starlette's outermost middleware, which logs the traceback
                if not status[0]:
                    status[0] = 500
                    state.setdefault("error", f"{type(e).__name__}: {e}")
                raise
        finally:
            self.count(scope["path"], state, status[0])
            self.log(scope, state, status[0], time.perf_counter() - t0)

    def check_key(self, path: str, headers: dict, raw_headers: list) -> None:
        # RFC 9110 allows one Authorization field; of two, which one decides is up to each proxy on the way
        given = sum(name.lower() == b"authorization" for name, _ in raw_headers)
        if given > 1:
            raise _Refused(400, f"Authorization: {given} headers, expected one", "duplicate_header")
        protected = path.startswith("/v1/") or (path == "/metrics" and not self.metrics_public)
        if not (self.api_key and protected):
            return
        scheme, _, given = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise _Refused(401, "Authorization: missing or wrong API key (expected 'Bearer <key>')",
                           "invalid_api_key")

    async def read_body(self, receive, headers: dict):
        """The whole body, counted as it arrives; returns a `receive` that replays it, then passes through."""
        limit = self.max_request_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _Refused(413, f"body: {length} bytes exceed --max-request-bytes {limit}", "request_too_large")
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _Refused(408, f"body: not received within {self.body_timeout:g} s (--body-timeout)",
                               "request_timeout") from None
            if message["type"] == "http.disconnect":
                raise _Gone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(413, f"body: more than {limit} bytes (--max-request-bytes)", "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return replayed.pop() if replayed else await receive()

        return replay

    def count(self, path: str, state: dict, status: int) -> None:
        """Every refusal and failure is counted, whoever answered it (the routes count their own outcomes)."""
        if self.metrics is None or state.get("counted") or status < 400 or status == 499:
            return
        outcome = "busy" if status == 503 else "error" if status >= 500 else "rejected"
        endpoint = path if path in ENDPOINTS else "other"  # (a scanner's paths must not become label values)
        self.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    @staticmethod
    def log(scope, state: dict, status: int, seconds: float) -> None:
        client = scope.get("client") or ("-", 0)
        parts = [f"{client[0]}", scope["method"], scope["path"], str(status), f"{seconds * 1000:.1f}ms"]
        for key, value in (state.get("access") or {}).items():
            parts.append(f"{key}={value}")
        if state.get("error"):
            parts.append(f"error={json.dumps(state['error'])}")
        access_log.info(" ".join(parts))


async def _json(send, status: int, body: dict, headers: dict) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
           (b"connection", b"close"), *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
