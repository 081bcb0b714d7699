"""OpenAI routes: /v1/chat/completions and /v1/completions, streaming and not."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from ingress.client import ModelClient, require_model
from ingress.errors import OPENAI_ERRORS
from ingress.openai.convert import chat_request, completion_request
from ingress.openai.models import ChatCompletionRequest, CompletionRequest
from ingress.openai.render import ResponseBuilder, ResponseMeta
from ingress.protocol import WireProtocol
from ingress.sse import DONE_FRAME, SSE_HEADERS, data_frame
from ingress.streaming import open_stream, sse_stream
from ingress.wire_json import JSONBody
from replicas.contract import ErrorKind, Failed, GenerationRequest, OutputEvent
from replicas.errors import from_event

router = APIRouter()

OPENAI = WireProtocol(
    name="openai",
    prefixes=("/v1/chat/completions", "/v1/completions"),
    router=router,
    errors=OPENAI_ERRORS,
)


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
        frames = sse_stream(opened, ChunkWriter(builder), OPENAI.ping_frame)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        async for event in opened.events():
            if isinstance(event, Failed):
                raise from_event(event)
            builder.feed(event)
    finally:
        await opened.aclose()  # a client that left cancels its generation
    if builder.finished is None:
        raise from_event(_CUT_SHORT)
    return JSONBody(builder.body())


_CUT_SHORT = Failed(ErrorKind.INTERNAL, "the model stream ended unexpectedly")


class ChunkWriter:
    """`ResponseBuilder` chunks as `data:` frames; `[DONE]` only after a clean finish."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self._builder = builder
        self._failed = False

    @property
    def done(self) -> bool:
        return self._failed or self._builder.finished is not None

    def start(self) -> list[str]:
        return []

    def feed(self, event: OutputEvent) -> list[str]:
        if isinstance(event, Failed):
            self._failed = True
            return [OPENAI.error_frame(event.kind, event.message, event.param)]
        return [data_frame(chunk) for chunk in self._builder.feed(event)]

    def finish(self) -> list[str]:
        if self._failed:
            return []
        if self._builder.finished is None:
            return self.feed(_CUT_SHORT)
        return [DONE_FRAME]
