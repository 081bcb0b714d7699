"""OpenAI routes: /v1/chat/completions and /v1/completions, streaming and not; with them
/v1/embeddings (`embeddings.py`), /v1/rerank (`rerank.py`, the Cohere/Jina/vLLM shape) and
vLLM's tokenizer endpoints (`tokenize.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ingress.client import ModelClient, adapted, require_model
from ingress.errors import OPENAI_ERRORS
from ingress.media import MediaParts
from ingress.openai import embeddings, rerank, tokenize
from ingress.openai.choices import ChoicesRenderer, FanOut
from ingress.openai.convert import chat_request, completion_prompts, completion_request
from ingress.openai.models import ChatCompletionRequest, CompletionRequest
from ingress.openai.render import CompletionRenderer, ResponseMeta
from ingress.protocol import WireProtocol
from ingress.sse import DONE_FRAME
from ingress.streaming import respond
from ingress.tenancy.seat import asked_priority

router = APIRouter()
router.include_router(tokenize.router)  # vLLM's tokenizer endpoints, in OpenAI's error shape
router.include_router(embeddings.router)
router.include_router(rerank.router)

OPENAI = WireProtocol(
    name="openai",
    prefixes=("/v1/chat/completions", "/v1/completions", *tokenize.PATHS, *embeddings.PATHS,
              *rerank.PATHS),
    router=router,
    errors=OPENAI_ERRORS,
    done_frame=DONE_FRAME,
)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    asked_priority(body.priority)
    card = require_model(client, body.model)
    media = MediaParts.for_model(card, request.app.state.image_limits)
    gen = adapted(await media.resolve(chat_request(body, card.id, media)), card)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    meta = ResponseMeta.new(gen.request_id, body.model, "chat")
    warnings = media.warnings()
    if body.n > 1:
        return await respond(FanOut(client, body.n, warnings), gen,
                             ChoicesRenderer(meta, body.n, include_usage,
                                             logprobs=bool(body.logprobs)),
                             OPENAI, body.stream, warnings=warnings)
    renderer = CompletionRenderer(meta, include_usage, logprobs=bool(body.logprobs))
    return await respond(client, gen, renderer, OPENAI, body.stream, warnings=warnings)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    asked_priority(body.priority)
    card = require_model(client, body.model)
    gen = adapted(completion_request(body, card.id), card)
    prompts = completion_prompts(body)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    meta = ResponseMeta.new(gen.request_id, body.model, "completion")
    logprobs = body.logprobs is not None
    if body.n > 1 or len(prompts) > 1:
        return await respond(FanOut(client, body.n, prompts=prompts), gen,
                             ChoicesRenderer(meta, body.n, include_usage, logprobs=logprobs,
                                             prompts=len(prompts)),
                             OPENAI, body.stream)
    renderer = CompletionRenderer(meta, include_usage, logprobs=logprobs)
    return await respond(client, gen, renderer, OPENAI, body.stream)
