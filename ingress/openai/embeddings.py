"""`POST /v1/embeddings` in OpenAI's shape.

`input` is a string, a list of strings, a list of token ids, or a list of such lists;
`encoding_format` is `float` (JSON numbers) or `base64` (each vector's little-endian
float32 bytes, base64, as OpenAI sends them and its SDK decodes by default); `dimensions`
truncates where the model allows it (the replica decides, and answers 400 where not);
`user` is accepted and ignored. Shape errors (no input, an empty one, too many) are a 400
here, before any replica time; the rest (a model that serves no embeddings, an input past
its length, an id outside its vocabulary) are the replica's.
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, Literal, Sequence, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ingress.client import ModelClient, require_model
from ingress.wire_json import JSONBody
from replicas.contract import EmbeddingInput, EmbeddingRequest, EmbeddingResult
from replicas.errors import InvalidRequestError

router = APIRouter()
PATHS = ("/v1/embeddings",)
# OpenAI's own bound on one request's inputs.
MAX_INPUTS = 2048


class EmbeddingsRequest(BaseModel):
    # Unknown fields are ignored, as on the other OpenAI routes.
    model_config = ConfigDict(extra="ignore")

    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted for the SDKs; nothing here reads it


def embedding_inputs(value: str | list[str] | list[int] | list[list[int]]
                     ) -> tuple[EmbeddingInput, ...]:
    """The inputs as the contract carries them; a 400 naming `input` for an empty one."""
    items: list[EmbeddingInput]
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [tuple(v for v in value if isinstance(v, int))]  # one input of token ids
    else:
        items = [v if isinstance(v, str) else tuple(v) for v in value
                 if isinstance(v, (str, list))]
    if not items:
        raise InvalidRequestError("`input` must hold at least one input", param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"`input` may hold at most {MAX_INPUTS} inputs; got "
                                  f"{len(items)}", param="input")
    empty = next((i for i, item in enumerate(items) if not item), None)
    if empty is not None:
        where = "`input`" if len(items) == 1 else f"`input[{empty}]`"
        raise InvalidRequestError(f"{where} is empty", param="input")
    return tuple(items)


def base64_vector(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI's SDK decodes with numpy's
    `frombuffer(..., dtype="float32")`."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def render(result: EmbeddingResult, model: str, encoding: str) -> dict[str, Any]:
    encode = base64_vector if encoding == "base64" else list
    tokens = result.prompt_tokens
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(vector)}
                     for i, vector in enumerate(result.vectors)],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
    client: ModelClient = request.app.state.client
    card = require_model(client, body.model)
    inputs = embedding_inputs(body.input)
    result = await client.embed(EmbeddingRequest(f"emb-{uuid.uuid4().hex}", card.id, inputs,
                                                 body.dimensions))
    # JSONBody writes the body in one json.dumps: FastAPI's encoder would walk every float.
    return JSONBody(render(result, body.model, body.encoding_format))
