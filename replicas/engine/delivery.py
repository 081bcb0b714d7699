"""Where a request's events go from the engine thread: an `EventSink` (`EventBuffer`, read
by the request's stream on its event loop) and `deliver`, which hands a step's events over
with at most one thread hop per event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol

from replicas.contract import OutputEvent, is_terminal


class EventSink(Protocol):
    """Where one request's events go. `put` may run on any thread (the engine's, mostly);
    it says whether the reader must be woken, which `wake` then does on `loop`."""

    loop: asyncio.AbstractEventLoop

    def put(self, events: list[OutputEvent]) -> bool: ...
    def wake(self) -> None: ...


class EventBuffer:
    """A request's events between the engine thread and the stream that reads them.

    The engine appends every step; the reader's loop is woken only when the reader waits
    for more, or when the request ends while it waits out a flush interval. A stream that
    sends a chunk every few steps then costs its event loop one wake-up per chunk, not one
    per token (a Queue wakes the reader on every put)."""

    # What wakes a waiting reader: any event, or only the last one.
    _ANY, _END = "any", "end"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._events: list[OutputEvent] = []
        self._wake_on: str | None = None  # set by the reader while it waits
        self._ready = asyncio.Event()  # touched on `loop` only

    def put(self, events: list[OutputEvent]) -> bool:
        with self._lock:
            self._events.extend(events)
            wake = self._wake_on == self._ANY or (
                self._wake_on == self._END and any(is_terminal(e) for e in events))
            if wake:
                self._wake_on = None
        return wake

    def wake(self) -> None:
        self._ready.set()

    def take(self) -> list[OutputEvent]:
        """Everything buffered so far (possibly nothing), without waiting."""
        with self._lock:
            events, self._events = self._events, []
        return events

    async def next(self, hold_until: float = 0.0) -> list[OutputEvent]:
        """At least one event; then, until `hold_until` (loop time), whatever else arrives,
        cut short by the request's end: several steps' tokens leave as one chunk."""
        events = await self._wait(self._ANY, None)
        linger = hold_until - self.loop.time()
        if linger > 0 and not any(is_terminal(e) for e in events):
            events += await self._wait(self._END, linger)
        return events

    async def _wait(self, wake_on: str, timeout: float | None) -> list[OutputEvent]:
        with self._lock:
            if any(wake_on == self._ANY or is_terminal(e) for e in self._events):
                events, self._events = self._events, []
                return events
            self._wake_on = wake_on
            self._ready.clear()  # on the loop, as `wake` is: no wake-up can slip between
        try:
            if timeout is None:
                await self._ready.wait()
            else:
                await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._wake_on = None
        return self.take()


def deliver(outbox: list[tuple[EventSink, list[OutputEvent]]]) -> None:
    """Hand each request its events; at most one thread hop per event loop per step, and
    none where no reader waits."""
    woken: dict[asyncio.AbstractEventLoop, list[EventSink]] = {}
    for sink, events in outbox:
        if sink.put(events):
            woken.setdefault(sink.loop, []).append(sink)
    for loop, sinks in woken.items():
        try:
            loop.call_soon_threadsafe(_wake_all, sinks)
        except RuntimeError:  # the loop closed: its requests are gone
            pass


def _wake_all(sinks: list[EventSink]) -> None:
    for sink in sinks:
        sink.wake()
