"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Clients that count or cut prompts on their own call them; lm-evaluation-harness probes
`/tokenizer_info` and `/tokenize` and, finding them, tokenizes through the server instead
of downloading the tokenizer. A prompt tokenizes exactly as a completion with it would run
(`add_special_tokens: false` leaves out the tokenizer's BOS), messages exactly as a chat
request with them would (template, tools and `chat_template_kwargs` included). `model` may
be left out when one model is served first in the config: it is then that one.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from ingress.client import ModelCard, ModelClient, require_model
from ingress.openai.convert import chat_request
from ingress.openai.models import ChatCompletionRequest, ChatMessageIn, ToolDef
from ingress.tenancy.seat import check_tenant_model
from replicas.contract import GenerationRequest, TextPrompt
from replicas.errors import InvalidRequestError

router = APIRouter()
PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeRequest(_Wire):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Wire):
    model: str | None = None
    tokens: list[int]


def _card(client: ModelClient, model: str | None) -> ModelCard:
    return require_model(client, model) if model else client.models()[0]


def _request(body: TokenizeRequest, card: ModelCard) -> GenerationRequest:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of `prompt` and `messages`", param="prompt")
    if not body.add_generation_prompt:
        raise InvalidRequestError("messages render as a chat request would: with the "
                                  "generation prompt", param="add_generation_prompt")
    if body.return_token_strs:
        raise InvalidRequestError("return_token_strs is not supported; /detokenize gives "
                                  "any ids' text", param="return_token_strs")
    if body.prompt is not None:
        return GenerationRequest(f"tok-{uuid.uuid4().hex}", card.id, TextPrompt(body.prompt))
    try:  # what a chat request itself would refuse (no messages, say) is the client's 400
        chat = ChatCompletionRequest(model=card.id, messages=body.messages or [],
                                     tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    # Media as placeholders, whatever the model: a count, not a generation, is no reason
    # to fetch and decode images (a model that sees counts each as its placeholder's text).
    return chat_request(chat, card.id)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    client: ModelClient = request.app.state.client
    card = _card(client, body.model)
    # A chat renders its own special tokens through the template; only a prompt adds BOS.
    ids = await client.tokenize(_request(body, card),
                                body.add_special_tokens and body.prompt is not None)
    info = await client.tokenizer_info(card.id)
    return {"count": len(ids), "max_model_len": info.model_max_length, "tokens": list(ids),
            "token_strs": None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    client: ModelClient = request.app.state.client
    card = _card(client, body.model)
    return {"prompt": await client.detokenize(card.id, tuple(body.tokens))}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    client: ModelClient = request.app.state.client
    card = _card(client, model)
    check_tenant_model(client.resolve, card.id)  # the others: the tenant's client checks
    info = await client.tokenizer_info(card.id)
    return {"tokenizer_class": info.tokenizer_class, "eos_token": info.eos_token,
            "bos_token": info.bos_token, "pad_token": info.pad_token,
            "chat_template": info.chat_template, "model_max_length": info.model_max_length,
            "vocab_size": info.vocab_size}
