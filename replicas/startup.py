"""Startup progress: what is being built or loaded, the time so far, and what the work knows.

A model build or load can take minutes with nothing else to show, so it logs when it starts
(with the expected time where one is known), a heartbeat every `HEARTBEAT_S` while it runs,
and when it ends. Work that can say where it is reports that with `report(detail)` (the
built-in model's training: its step and current margin), and the heartbeat shows the
latest detail. No percentage: training stops when its margin is met, usually far below its
step bound, so a fraction of that bound would say little.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType

log = logging.getLogger("orchard.startup")

# Seconds between "still going" lines; tests shrink it.
HEARTBEAT_S = 10.0

_current: list["Progress"] = []  # the innermost running task gets `report`'s details
_setup = threading.Lock()


def _visible() -> None:
    """INFO lines reach stderr even where nothing configured logging (`serve run`'s driver
    and Ray workers leave the root logger at WARNING), else they would be dropped."""
    with _setup:
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        if not log.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s orchard: %(message)s"))
            log.addHandler(handler)


class Progress:
    def __init__(self, what: str, expected: str | None = None) -> None:
        self.what = what
        self.expected = expected
        self._detail = ""
        self._started = 0.0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def update(self, detail: str) -> None:
        self._detail = detail

    def status(self) -> str:
        elapsed = time.perf_counter() - self._started
        detail = f", {self._detail}" if self._detail else ""
        return f"{self.what}: {elapsed:.0f}s so far{detail}"

    def __enter__(self) -> "Progress":
        _visible()
        self._started = time.perf_counter()
        log.info("%s%s", self.what, f", {self.expected}" if self.expected else "")
        self._beat = threading.Thread(target=self._heartbeat, name="orchard-progress",
                                      daemon=True)
        self._beat.start()
        _current.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        _current.remove(self)
        self._stop.set()
        elapsed = time.perf_counter() - self._started
        if kind is None:
            log.info("%s: done in %.1fs", self.what, elapsed)
        else:
            log.info("%s: failed after %.1fs", self.what, elapsed)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            log.info("%s", self.status())


def report(detail: str) -> None:
    """Where the innermost running `Progress` is, e.g. "training step 23, min margin 2.41"
    (a no-op outside one): its next heartbeat shows it."""
    if _current:
        _current[-1].update(detail)


def announce(message: str) -> None:
    """One INFO line on the startup log (`serve run`'s output, as Progress's lines)."""
    _visible()
    log.info("%s", message)
