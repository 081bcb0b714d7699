"""Event streams: opening one (the first events are awaited before any HTTP status is
chosen), and the one SSE loop every protocol streams through."""

from __future__ import annotations

import asyncio
import typing
from dataclasses import dataclass
from typing import AsyncIterator

import anyio

from ingress.client import ModelClient
from replicas.contract import Failed, GenerationRequest, OutputEvent
from replicas.errors import ReplicaError, from_event

# Seconds without events before the protocol's ping frame, so proxies and clients do not
# time out while a long prompt is processed. Tests shrink it.
PING_INTERVAL_S = 5.0


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
        await _close(self.rest)


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


class FrameWriter(typing.Protocol):
    """One protocol's renderer, writing SSE text.

    `feed` gets every event, a `Failed` one included (a `ReplicaError` raised mid-stream
    arrives as its event), and sets `done` at a terminal event. `finish` ends the stream:
    after a terminal event its closing frames (e.g. `[DONE]`), otherwise the protocol's
    error for a stream that stopped short.
    """

    @property
    def done(self) -> bool: ...

    def start(self) -> list[str]: ...

    def feed(self, event: OutputEvent) -> list[str]: ...

    def finish(self) -> list[str]: ...


async def sse_stream(opened: OpenedStream, writer: FrameWriter, ping_frame: str,
                     ping_interval_s: float | None = None) -> AsyncIterator[str]:
    """The response as SSE text, one write per batch of events, pings while silent.

    The next batch is awaited as a task that survives ping timeouts, so waiting never
    cancels the event iterator and events keep their order. Closing this generator (the
    client went away, or the deadline passed) closes the event iterator, which cancels the
    generation.
    """
    interval = PING_INTERVAL_S if ping_interval_s is None else ping_interval_s
    waiting: asyncio.Future[list[OutputEvent]] | None = None
    try:
        first = writer.start() + _feed(writer, opened.first)
        if first:
            yield "".join(first)
        # Read to the iterator's end, past the terminal event, so a finished generation ends
        # as finished rather than being closed (cancelled) early.
        while True:
            waiting = asyncio.ensure_future(anext(opened.rest))
            while not (await asyncio.wait({waiting}, timeout=interval))[0]:
                if not writer.done:
                    yield ping_frame
            try:
                batch = waiting.result()
            except StopAsyncIteration:
                break
            except ReplicaError as error:
                batch = [error.as_event()]  # the status is sent: report it in the stream
            frames = _feed(writer, batch)
            if frames:
                yield "".join(frames)
        if not writer.done:
            yield "".join(writer.finish())  # it stopped short of a terminal event
    finally:
        # Shielded: on disconnect the server cancels this generator, and cleanup must still
        # reach the replica.
        with anyio.CancelScope(shield=True):
            if waiting is not None and not waiting.done():
                waiting.cancel()
                await asyncio.wait({waiting})
            await opened.aclose()


def _feed(writer: FrameWriter, batch: list[OutputEvent]) -> list[str]:
    """The frames for a batch; the terminal event's are followed by the closing ones."""
    frames: list[str] = []
    for event in batch:
        if writer.done:
            break  # the contract ends a stream at its terminal event
        frames.extend(writer.feed(event))
        if writer.done:
            frames.extend(writer.finish())
    return frames
