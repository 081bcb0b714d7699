"""Startup progress: what is being built or loaded, time so far, a percentage when known.

A model build or load can take minutes with nothing else to show, so it logs when it starts
(with the expected time where one is known), a heartbeat every `HEARTBEAT_S` while it runs,
and when it ends. Work that knows its fraction done (the built-in model's training steps)
reports it with `report(done, total)`, and the heartbeat shows it as a percentage.
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

_current: list["Progress"] = []  # the innermost running task gets `report`'s fractions
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
        self._fraction: float | None = None
        self._detail = ""
        self._started = 0.0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def update(self, done: int, total: int, label: str | None = None) -> None:
        self._fraction = min(1.0, done / total) if total > 0 else None
        self._detail = "" if label is None else label.format(done=done, total=total) + " "

    def status(self) -> str:
        elapsed = time.perf_counter() - self._started
        percent = "" if self._fraction is None else f", {self._detail}({self._fraction:.0%})"
        return f"{self.what}: {elapsed:.0f}s so far{percent}"

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


def report(done: int, total: int, label: str | None = None) -> None:
    """Fraction done of the innermost running `Progress` (a no-op outside one); `label`
    may name the units with `{done}` and `{total}`."""
    if _current:
        _current[-1].update(done, total, label)
