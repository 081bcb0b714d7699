"""The event-to-wire loop a stateful renderer shares: dispatch by event type, nothing after
the terminal event, and a stream that ends short of one is a failure."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from replicas.contract import (
    ErrorKind,
    Failed,
    Finished,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)

Out = TypeVar("Out")  # what one protocol emits: a stream frame, an SSE event


class EventRenderer(ABC, Generic[Out]):
    """`feed()` each event, then `finish()`; the same calls build the non-streaming body."""

    done = False

    def feed(self, event: OutputEvent) -> list[Out]:
        if self.done:
            return []  # the contract ends a stream at its terminal event
        if isinstance(event, TextDelta):
            return self._text(event) if event.text else []  # an empty delta opens nothing
        if isinstance(event, ToolCallStart):
            return self._call_start(event)
        if isinstance(event, ToolCallDelta):
            return self._call_delta(event)
        if isinstance(event, ToolCallEnd):
            return self._call_end(event)
        if isinstance(event, Finished):
            return self._finished(event)
        return self._failed(event)

    def finish(self) -> list[Out]:
        """End of the event stream; a stream that stopped short of a terminal event failed."""
        if self.done:
            return []
        return self._failed(Failed(ErrorKind.INTERNAL, "the model stream ended unexpectedly"))

    @abstractmethod
    def _text(self, delta: TextDelta) -> list[Out]: ...

    @abstractmethod
    def _call_start(self, start: ToolCallStart) -> list[Out]: ...

    @abstractmethod
    def _call_delta(self, delta: ToolCallDelta) -> list[Out]: ...

    @abstractmethod
    def _call_end(self, end: ToolCallEnd) -> list[Out]: ...

    @abstractmethod
    def _finished(self, finished: Finished) -> list[Out]: ...

    @abstractmethod
    def _failed(self, failed: Failed) -> list[Out]: ...
