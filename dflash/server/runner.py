"""Running the app under uvicorn: the drain on SIGTERM / SIGINT and a header timeout for idle connections."""

from __future__ import annotations

import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dflash.serve")


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        # the drain starts now, not at the lifespan's end: the running streams must still be served while it lasts
        self.on_exit()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            # uvicorn re-raises a captured signal after its graceful shutdown; a drained SIGTERM is a clean exit
            self._captured_signals.remove(sig)


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol, closing a connection that has not finished its first request's headers within
    `seconds` (uvicorn's timeout_keep_alive only covers idle connections between requests)."""

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                peer = (self.client or ("-",))[0]
                log.info("%s: no request headers within %g s (--header-timeout): connection closed", peer, seconds)
                self.transport.close()

    return Protocol


def run(server, host: str, port: int, log_level: str = "info", header_timeout: float = 30.0) -> None:
    """Serve until SIGINT / SIGTERM; running requests drain for at most server.drain_timeout seconds: those that
    cannot finish end with an error event (streams: and [DONE]), then the process exits."""
    config = uvicorn.Config(server.app(), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=server.drain_timeout, log_config=None,
                            http=header_timeout_protocol(header_timeout))
    _Uvicorn(config, on_exit=lambda: server.scheduler.drain(server.drain_cutoff())).run()
