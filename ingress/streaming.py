"""Opening an event stream: the first event is awaited before any HTTP status is chosen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from ingress.client import ModelClient
from replicas.contract import Failed, GenerationRequest, OutputEvent
from replicas.errors import from_event


@dataclass
class OpenedStream:
    """A stream whose first batch has arrived; iterate it for every event in order."""

    first: list[OutputEvent]
    rest: AsyncIterator[list[OutputEvent]]

    async def events(self) -> AsyncIterator[OutputEvent]:
        for event in self.first:
            yield event
        async for batch in self.rest:
            for event in batch:
                yield event

    async def batches(self) -> AsyncIterator[list[OutputEvent]]:
        yield self.first
        async for batch in self.rest:
            yield batch

    async def aclose(self) -> None:
        aclose = getattr(self.rest, "aclose", None)
        if aclose is not None:
            await aclose()


async def open_stream(client: ModelClient, request: GenerationRequest) -> OpenedStream:
    """Start a generation and wait for its first events.

    Raises `ReplicaError` when the stream fails before producing any text, so the caller can
    answer with a proper error status instead of a 200 stream that dies.
    """
    rest = client.stream(request).__aiter__()
    try:
        first = await rest.__anext__()
    except StopAsyncIteration:
        first = []
    if first and isinstance(first[0], Failed):
        await _close(rest)
        raise from_event(first[0])
    return OpenedStream(first, rest)


async def _close(it: AsyncIterator[list[OutputEvent]]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()
