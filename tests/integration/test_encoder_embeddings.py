"""An encoder embedding model (`builtin:embed-bert`, mlx-embeddings' BERT) in a real
`ModelReplica` without Ray: its vectors are mlx-embeddings' own, batched or alone, it
serves embeddings only, and the official `openai` SDK reaches it through the colocated
client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import openai
import pytest
from fastapi.testclient import TestClient

from deployments.model_clients import LocalModelClient
from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    Failed,
    GenerationRequest,
)
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import stream_events

TOLERANCE = 1e-4  # max abs difference from mlx-embeddings' own output
TEXTS = ("The weather in Paris is sunny.", "hi",
         "Tokyo, Delhi and Shanghai are large cities with many people living in them.")


def start(**options: Any) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="bert", source="builtin:embed-bert", **options))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def encoder() -> Iterator[ModelReplica]:
    rep = start()
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def library() -> Any:
    """mlx-embeddings' own load of the same files: the reference."""
    from mlx_embeddings.utils import load

    return load(str(resolve_source("builtin:embed-bert")))


def vectors(rep: ModelReplica, *inputs: Any) -> tuple[tuple[float, ...], ...]:
    result = asyncio.run(rep.embed(EmbeddingRequest("e", "bert", tuple(inputs))))
    assert isinstance(result, EmbeddingResult), result
    return result.vectors


def max_diff(a: Any, b: Any) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def reference(library: Any, text: str, pooling: str) -> list[float]:
    """mlx-embeddings on one text alone (no padding): its CLS state normalized, or its own
    `text_embeds` (mean pooled, normalized)."""
    model, tokenizer = library
    ids = mx.array([tokenizer(text)["input_ids"]])
    out = model(ids)
    if pooling == "mean":
        return out.text_embeds[0].tolist()  # type: ignore[no-any-return]
    cls = out.last_hidden_state[0, 0]
    return (cls / mx.linalg.norm(cls)).tolist()  # type: ignore[no-any-return]


def test_vectors_are_mlx_embeddings_own_in_a_padded_batch(encoder: ModelReplica,
                                                           library: Any) -> None:
    got = vectors(encoder, *TEXTS)  # one forward: the short ones right-padded, masked
    for text, vector in zip(TEXTS, got):
        assert len(vector) == 128
        assert max_diff(vector, reference(library, text, "cls")) <= TOLERANCE


def test_mean_pooling_is_mlx_embeddings_text_embeds(library: Any) -> None:
    rep = start(embeddings="mean")
    try:
        got = vectors(rep, *TEXTS)
    finally:
        rep.shutdown()
    for text, vector in zip(TEXTS, got):
        assert max_diff(vector, reference(library, text, "mean")) <= TOLERANCE


def test_it_serves_embeddings_only(encoder: ModelReplica) -> None:
    events = stream_events(encoder, GenerationRequest(
        "g", "bert", ChatPrompt((ChatMessage("user", "Hello"),))))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].kind is ErrorKind.INVALID_REQUEST
    assert "/v1/embeddings only" in events[0].message
    assert vectors(encoder, "still serving")


def test_the_sdk_through_the_colocated_client(encoder: ModelReplica) -> None:
    card = ModelCard("bert", capabilities=("embeddings",))
    http = TestClient(create_app(LocalModelClient(encoder, card, max_ongoing=4)))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    result = client.embeddings.create(model="bert", input=list(TEXTS))
    for item, want in zip(result.data, vectors(encoder, *TEXTS)):
        assert max_diff(item.embedding, want) <= TOLERANCE
    with pytest.raises(openai.BadRequestError, match="at most 512"):
        client.embeddings.create(model="bert", input=[[5] * 513])
    with pytest.raises(openai.BadRequestError, match="embeddings only"):
        client.chat.completions.create(model="bert", messages=[{"role": "user",
                                                                "content": "Hi"}])
