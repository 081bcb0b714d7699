"""`POST /v1/embeddings` over a real `serve run` on loopback, through the official `openai`
SDK: `builtin:embed` (an embedding checkpoint, found by its sentence-transformers files,
with `embedding_dimensions` on) next to the chat model `builtin:tiny` (not opted in), two
models so the two-hop layout (the Ray handle client) serves them.

The vectors are checked against the same pooling run in this process on the same model
(`replicas.engine.model.embedding`, on the built files), within TOLERANCE; the colocated client
is covered in-process (tests/integration/test_embeddings_replica.py).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import openai
import pytest

from replicas.engine.model.embedding import PoolingSpec, embed_rows
from replicas.sources import load_source
from tests.e2e.shared_app import shared_models
from tests.observability.test_observability_http import App

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4  # max abs difference from the in-process pooling, and between batchings
WIDTH = 256  # builtin:embed's hidden size
MAX_TOKENS = 2048  # its sentence_bert_config.json's max_seq_length
MODELS = [
    {"id": "orchard-embed", "source": "builtin:embed", "embedding_dimensions": True,
     "max_ongoing_requests": 16},
    {"id": "orchard-tiny", "source": "builtin:tiny", "max_ongoing_requests": 16},
    # An encoder (BERT, through mlx-embeddings: replicas/encoder.py).
    {"id": "orchard-bert", "source": "builtin:embed-bert", "max_ongoing_requests": 16},
]
TEXTS = ["The weather in Paris is sunny.", "hi",
         "Tokyo, Delhi and Shanghai are large cities with many people living in them."]


@pytest.fixture(scope="module")
def base_url(shared_app: App) -> str:
    """MODELS, served with the other modules' extra models by one app (conftest)."""
    return shared_app.serve.base_url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def local() -> Any:
    """builtin:embed loaded in this process, as a replica loads it."""
    return load_source("builtin:embed")


def reference(local: Any, inputs: list[Any]) -> list[list[float]]:
    """The same pooling in this process, each input alone: the tokenizer's ids (with the
    `<|endoftext|>` it appends), last token, normalized."""
    out = []
    for item in inputs:
        ids = item if isinstance(item, list) else local.hf_tokenizer.encode(item)
        (vector,) = embed_rows(local.model, [ids], PoolingSpec("last_token", True))
        out.append(vector)
    return out


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= TOLERANCE


def norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def test_one_string(client: openai.OpenAI, local: Any) -> None:
    result = client.embeddings.create(model="orchard-embed", input=TEXTS[0],
                                      encoding_format="float")
    (item,) = result.data
    assert result.model == "orchard-embed" and item.index == 0 and len(item.embedding) == WIDTH
    assert abs(norm(item.embedding) - 1) < 1e-5
    assert close(item.embedding, reference(local, [TEXTS[0]])[0])
    tokens = len(local.hf_tokenizer.encode(TEXTS[0]))
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (tokens, tokens)


def test_a_list_equals_each_text_alone(client: openai.OpenAI, local: Any) -> None:
    batch = client.embeddings.create(model="orchard-embed", input=TEXTS,
                                     encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for text, item, want in zip(TEXTS, batch.data, reference(local, TEXTS)):
        alone = client.embeddings.create(model="orchard-embed", input=text,
                                         encoding_format="float").data[0].embedding
        assert close(item.embedding, alone) and close(item.embedding, want)
        assert abs(norm(item.embedding) - 1) < 1e-5
    assert batch.usage.prompt_tokens == sum(len(local.hf_tokenizer.encode(t)) for t in TEXTS)


def test_token_ids(client: openai.OpenAI, local: Any) -> None:
    ids = [local.hf_tokenizer.encode(t) for t in TEXTS[:2]]
    one = client.embeddings.create(model="orchard-embed", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="orchard-embed", input=ids, encoding_format="float")
    text = client.embeddings.create(model="orchard-embed", input=TEXTS[:2],
                                    encoding_format="float")
    assert close(one.data[0].embedding, text.data[0].embedding)
    for from_ids, from_text in zip(many.data, text.data):
        assert close(from_ids.embedding, from_text.embedding)
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_base64_decodes_to_the_floats(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="orchard-embed", input=TEXTS,
                                      encoding_format="float")
    packed = client.embeddings.create(model="orchard-embed", input=TEXTS,
                                      encoding_format="base64")
    decoded = client.embeddings.create(model="orchard-embed", input=TEXTS)  # the SDK's way
    for f, b, d in zip(floats.data, packed.data, decoded.data):
        raw = base64.b64decode(b.embedding)  # type: ignore[arg-type]
        assert list(struct.unpack(f"<{WIDTH}f", raw)) == f.embedding == list(d.embedding)


def test_dimensions(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model="orchard-embed", input=TEXTS[0],
                                    encoding_format="float").data[0].embedding
    short = client.embeddings.create(model="orchard-embed", input=TEXTS[0], dimensions=64,
                                     encoding_format="float").data[0].embedding
    assert len(short) == 64 and abs(norm(short) - 1) < 1e-5
    scale = norm(full[:64])
    assert close(short, [x / scale for x in full[:64]])


@pytest.mark.parametrize(("model", "body", "says"), [
    ("orchard-embed", {"input": ""}, "`input` is empty"),
    ("orchard-embed", {"input": [[1] * (MAX_TOKENS + 1)]}, f"at most {MAX_TOKENS}"),
    ("orchard-embed", {"input": "x", "dimensions": WIDTH + 1}, f"between 1 and {WIDTH}"),
    ("orchard-tiny", {"input": "hello"}, "does not serve embeddings"),
])
def test_400s(client: openai.OpenAI, model: str, body: dict[str, Any], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, **body)
    assert caught.value.status_code == 400 and says in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_too_long_is_context_length_exceeded(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/embeddings", timeout=60, json={
        "model": "orchard-embed", "input": [1] * (MAX_TOKENS + 1)})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_models_say_what_each_model_does(client: openai.OpenAI) -> None:
    models = client.models.list().data
    listed = {m.id: m.model_extra["capabilities"] for m in models}  # type: ignore[index]
    # Every model the shared app serves is listed (beside the adapters some serve, each
    # listed under its base's `root`), these three exactly so.
    assert {m.id for m in models if (m.model_extra or {}).get("root", m.id) == m.id} == \
        {m["id"] for m in shared_models()[0]}
    assert {str(m["id"]): listed[str(m["id"])] for m in MODELS} == {
        "orchard-embed": ["embeddings"], "orchard-tiny": ["text"],
        "orchard-bert": ["embeddings"]}
    chat = client.chat.completions.create(model="orchard-tiny", max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content is not None  # the chat model still chats


def test_an_encoder_embeds_and_only_embeds(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="orchard-bert", input=TEXTS)
    assert len(result.data) == len(TEXTS)
    for item in result.data:
        assert len(item.embedding) == 128  # builtin:embed-bert's hidden size
        assert abs(math.fsum(x * x for x in item.embedding) - 1.0) < 1e-4  # normalized
    with pytest.raises(openai.BadRequestError, match="embeddings only"):
        client.chat.completions.create(model="orchard-bert", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
