"""Pure ASGI middleware (it passes http.disconnect through, which streaming needs): the API key, the body-size
limit announced by Content-Length, and one access log line per request."""

from __future__ import annotations

import hmac
import json
import logging
import time

from .protocol import error_body

access_log = logging.getLogger("dflash.serve.access")


class AccessLog:
    def __init__(self, app, api_key: str | None = None, max_request_bytes: int = 1 << 20):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]
        state = scope.setdefault("state", {})
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self.refuse(scope["path"], headers)

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if refusal is not None:
                code, body, extra = refusal
                state["error"] = body["error"]["message"]
                await _json(send, code, body, extra)
                status[0] = code
            else:
                await self.app(scope, receive, logged_send)
        finally:
            self.log(scope, state, status[0], time.perf_counter() - t0)

    def refuse(self, path: str, headers: dict):
        if self.api_key and path.startswith("/v1/"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return 401, error_body("Authorization: missing or wrong API key (expected 'Bearer <key>')",
                                       "authentication_error", None, "invalid_api_key"), {}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return 413, error_body(f"body: {length} bytes exceed --max-request-bytes {self.max_request_bytes}",
                                   "invalid_request_error", None, "request_too_large"), {}
        return None

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
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
