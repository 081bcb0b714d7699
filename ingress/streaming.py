"""The response path every protocol shares: opening a stream (the first events are awaited
before any HTTP status is chosen), then `respond`, which renders it through the protocol's
`EventRenderer` as one JSON body or through the one SSE loop."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping

import anyio
from fastapi.responses import Response, StreamingResponse

from ingress.client import ModelClient
from ingress.errors import CodedError
from ingress.protocol import WARNING_HEADER, WireProtocol
from ingress.rendering import EventRenderer
from ingress.sse import SSE_HEADERS
from ingress.wire_json import JSONBody
from replicas.contract import Failed, Finished, GenerationRequest, OutputEvent
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

    def with_warnings(self, warnings: tuple[str, ...]) -> OpenedStream:
        """This stream with `warnings` (what the adapter changed about the request) before
        the replica's own in its `Finished`, which every renderer already reports."""
        if not warnings:
            return self
        return OpenedStream(_warned(self.first, warnings), _warned_batches(self.rest, warnings))


def _warned(batch: list[OutputEvent], warnings: tuple[str, ...]) -> list[OutputEvent]:
    return [dataclasses.replace(e, warnings=warnings + e.warnings) if isinstance(e, Finished)
            else e for e in batch]


async def _warned_batches(rest: AsyncIterator[list[OutputEvent]],
                          warnings: tuple[str, ...]) -> AsyncGenerator[list[OutputEvent], None]:
    try:
        async for batch in rest:
            yield _warned(batch, warnings)
    finally:  # closing this must still close (cancel) the generation underneath
        await _close(rest)


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


async def respond(client: ModelClient, generation: GenerationRequest,
                  renderer: EventRenderer[Any], protocol: WireProtocol, stream: bool, *,
                  headers: Mapping[str, str] | None = None,
                  on_complete: Callable[[], Awaitable[None]] | None = None,
                  warnings: tuple[str, ...] = ()) -> Response:
    """One generation as the protocol's response: an SSE stream or one JSON body.

    `warnings` (what the adapter left out of the request) go in the `x-orchard-warning`
    header and, through the terminal `Finished`, in the body's `orchard_warnings`.

    A failure before the first event raises (a real 4xx/5xx status), and so does any failure
    of a non-streaming response. `on_complete` runs once the response is whole and did not
    fail: before a stream closes, so a client that read it to the end can rely on its effect.
    """
    opened = (await open_stream(client, generation)).with_warnings(warnings)
    extra = dict(headers or {})
    if warnings:
        extra[WARNING_HEADER] = "; ".join(warnings)
    if stream:
        frames = sse_stream(opened, renderer, protocol)
        if on_complete is not None:
            frames = _then(frames, renderer, protocol, on_complete)
        return StreamingResponse(frames, media_type="text/event-stream",
                                 headers=SSE_HEADERS | extra)
    try:
        async for event in opened.events():
            renderer.feed(event)  # to the iterator's end: a finished generation ends itself
    finally:
        await opened.aclose()  # a client that left cancels its generation
    renderer.finish()
    if renderer.failure is not None:
        raise from_event(renderer.failure)
    if on_complete is not None:
        await on_complete()
    return JSONBody(renderer.body(), headers=extra)


async def _then(frames: AsyncGenerator[str, None], renderer: EventRenderer[Any],
                protocol: WireProtocol,
                on_complete: Callable[[], Awaitable[None]]) -> AsyncGenerator[str, None]:
    # Closing this closes the SSE loop at once, so a client that leaves still cancels.
    async with aclosing(frames):
        async for frame in frames:
            yield frame
    if renderer.failure is None:
        try:
            await on_complete()
        except ReplicaError as error:
            # E.g. the response store is down: the status is sent, so the stream says it
            # (an SDK raises) rather than ending as if the response were kept.
            code = error.code if isinstance(error, CodedError) else None
            yield protocol.error_frame(error.kind, error.message, error.param, code=code)


async def sse_stream(opened: OpenedStream, renderer: EventRenderer[Any],
                     protocol: WireProtocol) -> AsyncGenerator[str, None]:
    """The response as SSE text, one write per batch of events, pings while silent.

    The next batch is awaited as a task that survives ping timeouts, so waiting never
    cancels the event iterator and events keep their order. Closing this generator (the
    client went away, or the deadline passed) closes the event iterator, which cancels the
    generation.
    """
    waiting: asyncio.Future[list[OutputEvent]] | None = None
    try:
        first = _frames(renderer, renderer.start()) + _feed(renderer, protocol, opened.first)
        if first:
            yield "".join(first)
        # Read to the iterator's end, past the terminal event, so a finished generation ends
        # as finished rather than being closed (cancelled) early.
        while True:
            waiting = asyncio.ensure_future(anext(opened.rest))
            while not (await asyncio.wait({waiting}, timeout=PING_INTERVAL_S))[0]:
                if not renderer.done:
                    yield protocol.ping_frame
            try:
                batch = waiting.result()
            except StopAsyncIteration:
                break
            except ReplicaError as error:
                batch = [error.as_event()]  # the status is sent: report it in the stream
            frames = _feed(renderer, protocol, batch)
            if frames:
                yield "".join(frames)
        if not renderer.done:  # it stopped short of a terminal event
            yield "".join(_frames(renderer, renderer.finish()))
    finally:
        # Shielded: on disconnect the server cancels this generator, and cleanup must still
        # reach the replica.
        with anyio.CancelScope(shield=True):
            if waiting is not None and not waiting.done():
                waiting.cancel()
                await asyncio.wait({waiting})
            await opened.aclose()


def _feed(renderer: EventRenderer[Any], protocol: WireProtocol,
          batch: list[OutputEvent]) -> list[str]:
    """The frames for a batch; a clean finish is followed by the protocol's closing frame."""
    frames: list[str] = []
    for event in batch:
        if renderer.done:
            break  # the contract ends a stream at its terminal event
        frames.extend(_frames(renderer, renderer.feed(event)))
        if renderer.done and renderer.failure is None and protocol.done_frame:
            frames.append(protocol.done_frame)
    return frames


def _frames(renderer: EventRenderer[Any], items: list[Any]) -> list[str]:
    return [renderer.frame(item) for item in items]
