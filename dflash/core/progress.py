"""A line on stderr every few seconds while a long wait runs (measuring a device's costs, compiling forwards): a
silent minute reads as a hang, and under load these waits take one or two."""

from __future__ import annotations

import sys
import threading
import time

HEARTBEAT_SECONDS = 5.0  # at most this long without a line


class Heartbeat:
    """`with Heartbeat("measuring"):` prints "dflash: still measuring, N s so far: WHAT" every HEARTBEAT_SECONDS,
    WHAT being the latest `note()`. Its thread sleeps between lines, so what it reports on shares the CPU with nothing
    but a print. Heartbeats nest: while an inner one runs, the outer one is quiet."""

    now: Heartbeat | None = None  # the innermost one running: note() tells it what runs, and only it speaks

    def __init__(self, doing: str, start: float | None = None):
        self.doing, self.what, self.done = doing, "", threading.Event()
        self.start = time.perf_counter() if start is None else start
        self.thread = threading.Thread(target=self.beat, daemon=True)
        self.outer: Heartbeat | None = None

    def beat(self) -> None:
        while not self.done.wait(HEARTBEAT_SECONDS):
            self.speak()

    def speak(self) -> None:
        """One line, if this is the innermost heartbeat running (a wait inside this one speaks for both)."""
        if Heartbeat.now is self:
            print(f"dflash: still {self.doing}, {time.perf_counter() - self.start:.0f} s so far" +
                  (f": {self.what}" if self.what else ""), file=sys.stderr, flush=True)

    def __enter__(self) -> Heartbeat:
        self.outer, Heartbeat.now = Heartbeat.now, self
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        Heartbeat.now = self.outer


def note(what: str) -> None:
    """Say what runs now (in the running heartbeat's next line, if there is one)."""
    if Heartbeat.now is not None:
        Heartbeat.now.what = what
