"""`POST /v1/rerank` (also `/rerank` and `/v2/rerank`) in the shape Cohere, Jina and vLLM
share, with errors in OpenAI's shape (as vLLM answers them).

Request: `model`, `query`, `documents` (strings, or objects with a `text`), `top_n`
(the best N; all when unset or past the count), `return_documents` (default true, as Jina
and vLLM; Cohere's v2 leaves it out), `max_tokens_per_doc` (each document cut to its first
N tokens, as Cohere v2), and `instruction` (Qwen3-Reranker's `<Instruct>` line; its
default when unset). Response: `id`, `model`, `results` sorted by `relevance_score`
(descending, ties by index) with each document's `index` in the request and, where asked,
its `document.text`, and `usage.total_tokens` (every scored pair's tokens). Shape errors
are a 400 here; the replica refuses a model that does not rerank and a pair past its input
length, also with a 400.
"""

from __future__ import annotations

import uuid
from typing import Union

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ingress.client import ModelClient, require_model
from ingress.wire_json import JSONBody
from replicas.contract import RerankRequest
from replicas.errors import InvalidRequestError

router = APIRouter()
PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
# Cohere's bound on one request's documents.
MAX_DOCUMENTS = 1000


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Jina and Cohere v1 carry other fields

    text: str


class RerankBody(BaseModel):
    # Unknown fields (Cohere's `rank_fields`, vLLM's `truncate_prompt_tokens`) are ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    query: str
    documents: list[Union[str, TextDocument]]
    top_n: int | None = None
    return_documents: bool = True
    max_tokens_per_doc: int | None = None
    instruction: str | None = None


class RerankDocumentOut(BaseModel):
    text: str


class RerankItem(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocumentOut | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankItem]
    usage: RerankUsage


def document_texts(body: RerankBody) -> tuple[str, ...]:
    """The documents as texts, after the checks that need no model (each a 400 naming
    its field)."""
    if not body.query.strip():
        raise InvalidRequestError("`query` must not be empty", param="query")
    if not body.documents:
        raise InvalidRequestError("`documents` must hold at least one document",
                                  param="documents")
    if len(body.documents) > MAX_DOCUMENTS:
        raise InvalidRequestError(f"`documents` may hold at most {MAX_DOCUMENTS} documents; "
                                  f"got {len(body.documents)}", param="documents")
    if body.top_n is not None and body.top_n < 1:
        raise InvalidRequestError("`top_n` must be at least 1", param="top_n")
    if body.max_tokens_per_doc is not None and body.max_tokens_per_doc < 1:
        raise InvalidRequestError("`max_tokens_per_doc` must be at least 1",
                                  param="max_tokens_per_doc")
    return tuple(d if isinstance(d, str) else d.text for d in body.documents)


def ranked(scores: tuple[float, ...], texts: tuple[str, ...], top_n: int | None,
           with_documents: bool) -> list[RerankItem]:
    """The best `top_n` documents, highest score first (ties in request order)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    return [RerankItem(index=i, relevance_score=scores[i],
                       document=RerankDocumentOut(text=texts[i]) if with_documents else None)
            for i in order]


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankBody, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    card = require_model(client, body.model)
    texts = document_texts(body)
    request_id = f"rerank-{uuid.uuid4().hex}"
    result = await client.rerank(RerankRequest(request_id, card.id, body.query, texts,
                                               body.max_tokens_per_doc, body.instruction))
    response = RerankResponse(
        id=request_id, model=body.model,
        results=ranked(result.scores, texts, body.top_n, body.return_documents),
        usage=RerankUsage(total_tokens=result.prompt_tokens))
    return JSONBody(response.model_dump(exclude_none=True))
