"""The event-to-wire loop every protocol's renderer shares: dispatch by event type, nothing
after the terminal event, and a stream that ends short of one is a failure."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from replicas.contract import (
    ErrorKind,
    Failed,
    Finished,
    OutputEvent,
    TextDelta,
    TokenIds,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)

Out = TypeVar("Out")  # what one protocol emits: a stream frame, an SSE event


class EventRenderer(ABC, Generic[Out]):
    """`start()`, `feed()` each event, then `finish()`: a stream's items, each written as SSE
    text by `frame()`. The same calls build the non-streaming `body()`, so the two paths
    cannot disagree."""

    done = False  # a terminal event was rendered
    failure: Failed | None = None  # ... and it was this failure

    def start(self) -> list[Out]:
        """What a stream opens with, before any event."""
        return []

    def feed(self, event: OutputEvent) -> list[Out]:
        if self.done:
            return []  # the contract ends a stream at its terminal event
        if isinstance(event, TextDelta):
            # An empty delta opens nothing, unless it carries the last tokens' logprobs.
            return self._text(event) if event.text or event.logprobs else []
        if isinstance(event, ToolCallStart):
            return self._call_start(event)
        if isinstance(event, ToolCallDelta):
            return self._call_delta(event)
        if isinstance(event, ToolCallEnd):
            return self._call_end(event)
        if isinstance(event, Finished):
            self.done = True
            return self._finished(event)
        if isinstance(event, TokenIds):
            return []  # model clients take them out; nothing to render
        return self._fail(event)

    def finish(self) -> list[Out]:
        """End of the event stream; a stream that stopped short of a terminal event failed."""
        if self.done:
            return []
        return self._fail(Failed(ErrorKind.INTERNAL, "the model stream ended unexpectedly"))

    def _fail(self, failed: Failed) -> list[Out]:
        self.done = True
        self.failure = failed
        return self._failed(failed)

    @abstractmethod
    def frame(self, item: Out) -> str:
        """One stream item as SSE text."""

    @abstractmethod
    def body(self) -> dict[str, Any]:
        """The non-streaming response body; complete once a `Finished` event was fed."""

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
