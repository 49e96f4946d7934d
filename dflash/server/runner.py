"""Running the app under uvicorn: the listening socket bound before anything slow, the drain on SIGTERM / SIGINT
(run on the event loop before uvicorn's own shutdown, so the listener stays open and answers 503 while it lasts),
and a header timeout for every request of a connection."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core.errors import DFlashError

log = logging.getLogger("dflash.serve")

# After the drain has ended every response, uvicorn's shutdown closes the listener and gives the connections this
# long to close (a client that does not read its last bytes) before it cancels what is left.
CLOSE_GRACE = 1  # seconds (uvicorn takes an int)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound (not yet listening: connections are refused until the model is loaded) before
    anything slow, so that a port in use is one line at once rather than a traceback after the model load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a restart rebinds a port in TIME_WAIT)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise DFlashError(f"--port {port}: already in use on {host} (another server?); choose another "
                              "--port") from None
        raise DFlashError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, drain):
        super().__init__(config)
        self.drain = drain
        self.signalled: float | None = None

    def handle_exit(self, sig, frame) -> None:
        # a signal handler interrupts the event loop anywhere: it only notes the time; the drain runs on the loop
        if self.signalled is None:
            self.signalled = time.monotonic()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            # uvicorn re-raises a captured signal after its graceful shutdown; a drained SIGTERM is a clean exit
            self._captured_signals.remove(sig)

    async def main_loop(self) -> None:
        await super().main_loop()  # until SIGTERM / SIGINT
        # the drain comes before uvicorn's shutdown: the listener stays open (503 to new requests) while it lasts,
        # and it has ended every response itself when uvicorn's CLOSE_GRACE starts, so uvicorn never cancels a
        # stream mid-way
        await self.drain(self.signalled or time.monotonic(), abandoned=lambda: self.force_exit)


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not in within `seconds` of the
    moment it could send them: connecting, or the end of the previous response on a kept-alive connection.
    (uvicorn's timeout_keep_alive only covers an idle connection, and stops at the first byte of a request.)"""

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer: asyncio.TimerHandle | None = None
            self.await_headers()

        def on_response_complete(self) -> None:
            self.await_headers()
            super().on_response_complete()  # (may parse a pipelined request at once: handle_events disarms)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are in
                self.disarm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

        def await_headers(self) -> None:
            self.disarm()
            if not self.transport.is_closing():
                self.header_timer = self.loop.call_later(seconds, self.headers_timed_out)

        def disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def headers_timed_out(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                peer = (self.client or ("-",))[0]
                log.info("%s: no request headers within %g s (--header-timeout): connection closed", peer, seconds)
                self.transport.close()

    return Protocol


def run(server, sock: socket.socket, log_level: str = "info", header_timeout: float = 30.0) -> None:
    """Serve on `sock` (from bind) until SIGINT / SIGTERM, then drain (Server.drain) and exit."""
    config = uvicorn.Config(server.app(), log_level=log_level, access_log=False, log_config=None,
                            timeout_graceful_shutdown=CLOSE_GRACE, http=header_timeout_protocol(header_timeout))
    try:
        _Uvicorn(config, server.drain).run(sockets=[sock])
    finally:
        # however serving ended (uvicorn exits on a failed startup), the engine thread ends too: a worker of a
        # live executor is joined at interpreter exit, and an idle one waits for work forever
        server.scheduler.drain(0)
