"""OpenAI routes: /v1/chat/completions and /v1/completions, streaming and not."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ingress.client import ModelClient, require_model
from ingress.errors import Protocol, error_json
from ingress.openai.convert import chat_request, completion_request
from ingress.openai.models import ChatCompletionRequest, CompletionRequest
from ingress.openai.render import ResponseBuilder, ResponseMeta
from ingress.sse import DONE_FRAME, SSE_HEADERS, data_frame
from ingress.streaming import OpenedStream, open_stream
from replicas.contract import Failed, GenerationRequest
from replicas.errors import from_event

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    card = require_model(client, body.model)
    gen = chat_request(body, card.id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(client, gen, ResponseMeta.new(gen.request_id, body.model, "chat"),
                          body.stream, include_usage)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    card = require_model(client, body.model)
    gen = completion_request(body, card.id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(client, gen, ResponseMeta.new(gen.request_id, body.model, "completion"),
                          body.stream, include_usage)


async def _respond(client: ModelClient, gen: GenerationRequest, meta: ResponseMeta,
                   stream: bool, include_usage: bool) -> Response:
    opened = await open_stream(client, gen)  # an early failure raises: a proper 4xx/5xx
    builder = ResponseBuilder(meta, include_usage)
    if stream:
        return StreamingResponse(_sse(opened, builder), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        async for event in opened.events():
            if isinstance(event, Failed):
                raise from_event(event)
            builder.feed(event)
    finally:
        await opened.aclose()  # a client that left cancels its generation
    return JSONResponse(builder.body())


async def _sse(opened: OpenedStream, builder: ResponseBuilder) -> AsyncIterator[str]:
    try:
        async for batch in opened.batches():
            frames: list[str] = []
            for event in batch:
                if isinstance(event, Failed):
                    frames.append(f"data: {error_json(event.kind, event.message, Protocol.OPENAI)}\n\n")
                    yield "".join(frames)
                    return
                frames.extend(data_frame(chunk) for chunk in builder.feed(event))
            if frames:
                yield "".join(frames)  # one write per batch of events
        yield DONE_FRAME
    finally:
        await opened.aclose()
