"""`POST /v1/messages` and `POST /v1/messages/count_tokens`.

Errors leave as exceptions: `ReplicaError` for bad input and replica failures, pydantic's
`RequestValidationError` for malformed bodies. The app's handlers render both in
Anthropic's shape for `/v1/messages*` paths.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from ingress.anthropic.convert import (
    omits_thinking,
    to_count_request,
    to_generation_request,
)
from ingress.anthropic.models import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_validation_message,
)
from ingress.anthropic.render import MessageRenderer
from ingress.client import ModelClient, require_model
from ingress.errors import ANTHROPIC_ERRORS
from ingress.protocol import WireProtocol
from ingress.sse import SSE_HEADERS, event_frame
from ingress.streaming import open_stream, sse_stream
from ingress.wire_json import JSONBody
from replicas.contract import OutputEvent
from replicas.errors import from_event

# Seconds without events before a `ping` event, so proxies and clients do not time out
# while a long prompt is processed. Tests shrink it.
PING_INTERVAL_S = 5.0

router = APIRouter()


def _validation(exc: RequestValidationError) -> tuple[str, str | None]:
    return anthropic_validation_message(exc), None  # Anthropic names no `param`


ANTHROPIC = WireProtocol(
    name="anthropic",
    prefixes=("/v1/messages",),
    router=router,
    errors=ANTHROPIC_ERRORS,
    error_frame_of=lambda body: event_frame("error", body),
    ping_frame=event_frame("ping", {"type": "ping"}),
    validation_message=_validation,
)


def _client(request: Request) -> ModelClient:
    client: ModelClient = request.app.state.client
    return client


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    client = _client(request)
    card = require_model(client, body.model)
    generation = to_generation_request(body, card)
    renderer = MessageRenderer(generation.request_id, card.id, omit_thinking=omits_thinking(body))
    # Raises before any byte is sent when the generation fails at once: a real error status.
    opened = await open_stream(client, generation)
    if body.stream:
        frames = sse_stream(opened, EventWriter(renderer), ANTHROPIC.ping_frame,
                            PING_INTERVAL_S)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
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
    return JSONBody(renderer.message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    client = _client(request)
    card = require_model(client, body.model)
    return {"input_tokens": await client.count_tokens(to_count_request(body, card))}


class EventWriter:
    """`MessageRenderer` frames as named SSE events."""

    def __init__(self, renderer: MessageRenderer) -> None:
        self._renderer = renderer

    @property
    def done(self) -> bool:
        return self._renderer.done

    def start(self) -> list[str]:
        return [event_frame(*frame) for frame in self._renderer.start()]

    def feed(self, event: OutputEvent) -> list[str]:
        return [event_frame(*frame) for frame in self._renderer.feed(event)]

    def finish(self) -> list[str]:
        return [event_frame(*frame) for frame in self._renderer.finish()]
