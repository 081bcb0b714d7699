"""`POST /v1/messages` and `POST /v1/messages/count_tokens`.

Errors leave as exceptions: `ReplicaError` for bad input and replica failures, pydantic's
`RequestValidationError` for malformed bodies. The app's handlers render both in
Anthropic's shape for `/v1/messages*` paths.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

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
from ingress.client import ModelClient, adapted, require_model
from ingress.errors import ANTHROPIC_ERRORS
from ingress.media import MediaParts
from ingress.protocol import WireProtocol
from ingress.sse import event_frame
from ingress.streaming import respond

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
    media = MediaParts.for_model(card, request.app.state.image_limits)
    generation = adapted(await media.resolve(to_generation_request(body, card, media)), card)
    renderer = MessageRenderer(generation.request_id, card.id, omit_thinking=omits_thinking(body))
    return await respond(client, generation, renderer, ANTHROPIC, body.stream,
                         warnings=media.warnings())


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    client = _client(request)
    card = require_model(client, body.model)
    return {"input_tokens": len(await client.tokenize(to_count_request(body, card)))}

