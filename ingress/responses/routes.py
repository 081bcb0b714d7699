"""`POST /v1/responses` and `GET /v1/responses/{id}`: the OpenAI Responses API.

Errors leave as exceptions and render in OpenAI's shape (the `RESPONSES` protocol owns
`/v1/responses*`). Streams go through the shared SSE loop as named events.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ingress.client import ModelClient, adapted, require_model
from ingress.errors import OPENAI_ERRORS, CodedError
from ingress.media import MediaParts
from ingress.protocol import WARNING_HEADER, WireProtocol
from ingress.responses.convert import to_plan
from ingress.responses.models import ResponsesRequest
from ingress.responses.render import ResponseRenderer
from ingress.responses.store import ResponseStore, StoredResponse
from ingress.sse import event_frame
from ingress.streaming import respond
from replicas.contract import ErrorKind
from replicas.errors import NotFoundError

router = APIRouter()


def _error_event(body: dict[str, Any]) -> str:
    # The documented `error` stream event's fields, plus the OpenAI error object itself so
    # SDKs raise it as they do for other streams. The edge writes it without knowing the
    # sequence, so it carries none.
    error = body["error"]
    return event_frame("error", {"type": "error", "code": error["code"],
                                 "message": error["message"], "param": error["param"],
                                 "error": error})


RESPONSES = WireProtocol(
    name="responses",
    prefixes=("/v1/responses",),
    router=router,
    errors=OPENAI_ERRORS,
    error_frame_of=_error_event,
)


def _store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.response_store
    return store


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    store = _store(request)
    card = require_model(client, body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id)
        if previous is None:
            raise CodedError(ErrorKind.NOT_FOUND,
                             f"previous response '{body.previous_response_id}' not found",
                             code="previous_response_not_found", param="previous_response_id")
        history = previous.conversation()
    media = MediaParts.for_model(card, request.app.state.image_limits)
    plan = to_plan(body, card, history, media)
    plan = dataclasses.replace(plan, generation=adapted(await media.resolve(plan.generation),
                                                        card))
    renderer = ResponseRenderer(plan.generation.request_id, body.model, plan.echo,
                                reasoning_summary=plan.reasoning_summary, warnings=plan.warnings)
    headers = {WARNING_HEADER: "; ".join(plan.warnings)} if plan.warnings else {}

    async def save() -> None:
        await store.put(renderer.response["id"], StoredResponse(renderer.response, plan.items))

    return await respond(client, plan.generation, renderer, RESPONSES, body.stream,
                         headers=headers, on_complete=save if body.store else None)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    stored = await _store(request).get(response_id)
    if stored is None:
        raise NotFoundError(f"response '{response_id}' not found", param="response_id")
    return stored.response

