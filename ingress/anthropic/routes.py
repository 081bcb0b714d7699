"""`POST /v1/messages` and `POST /v1/messages/count_tokens`.

Errors leave as exceptions: `ReplicaError` for bad input and replica failures, pydantic's
`RequestValidationError` for malformed bodies. The app's handlers render both in
Anthropic's shape for `/v1/messages*` paths.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ingress.anthropic.convert import (
    to_count_request,
    to_generation_request,
)
from ingress.anthropic.models import CountTokensRequest, MessagesRequest
from ingress.anthropic.render import Frame, MessageRenderer
from ingress.client import ModelClient, require_model
from ingress.sse import SSE_HEADERS, event_frame
from ingress.streaming import OpenedStream, open_stream
from replicas.contract import OutputEvent
from replicas.errors import ReplicaError, from_event

# Seconds without events before a `ping` event, so proxies and clients do not time out
# while a long prompt is processed. Tests shrink it.
PING_INTERVAL_S = 5.0

_PING = event_frame("ping", {"type": "ping"})

router = APIRouter()


def _client(request: Request) -> ModelClient:
    client: ModelClient = request.app.state.client
    return client


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    client = _client(request)
    card = require_model(client, body.model)
    generation = to_generation_request(body, card)
    renderer = MessageRenderer(generation.request_id, card.id)
    # Raises before any byte is sent when the generation fails at once: a real error status.
    opened = await open_stream(client, generation)
    if body.stream:
        return StreamingResponse(
            _sse(opened, renderer), media_type="text/event-stream", headers=SSE_HEADERS
        )
    try:
        async for event in opened.events():
            renderer.feed(event)
            if renderer.done:
                break
    finally:
        await opened.aclose()
    renderer.finish()
    if renderer.failure is not None:
        raise from_event(renderer.failure)
    return JSONResponse(renderer.message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    client = _client(request)
    card = require_model(client, body.model)
    return {"input_tokens": await client.count_tokens(to_count_request(body, card))}


async def _sse(opened: OpenedStream, renderer: MessageRenderer) -> AsyncIterator[str]:
    """The message as SSE frames, with pings while the replica is silent.

    The next batch is awaited as a task that survives ping timeouts, so waiting never
    cancels the event iterator and events keep their order. Closing this generator (the
    client went away) closes the event iterator, which cancels the generation.
    """
    waiting: asyncio.Future[list[OutputEvent]] | None = None
    try:
        for frame in renderer.start() + _feed(renderer, opened.first):
            yield _encode(frame)
        while not renderer.done:
            waiting = asyncio.ensure_future(anext(opened.rest))
            while not (await asyncio.wait({waiting}, timeout=PING_INTERVAL_S))[0]:
                yield _PING
            try:
                batch = waiting.result()
            except StopAsyncIteration:
                break
            except ReplicaError as error:
                batch = [error.as_event()]  # the status is sent: report it in the stream
            for frame in _feed(renderer, batch):
                yield _encode(frame)
        for frame in renderer.finish():
            yield _encode(frame)
    finally:
        # Shielded: on disconnect the server cancels this generator, and cleanup must still
        # reach the replica.
        with anyio.CancelScope(shield=True):
            if waiting is not None and not waiting.done():
                waiting.cancel()
                await asyncio.wait({waiting})
            await opened.aclose()


def _feed(renderer: MessageRenderer, batch: list[OutputEvent]) -> list[Frame]:
    return [frame for event in batch for frame in renderer.feed(event)]


def _encode(frame: Frame) -> str:
    return event_frame(*frame)
