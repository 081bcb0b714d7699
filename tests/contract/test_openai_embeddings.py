"""`POST /v1/embeddings` through the official `openai` SDK and raw HTTP, against the real
app and a fake client: the request the replica gets, the response's shape in both
encodings, and the 400s and 404 the edge answers before any replica time."""

from __future__ import annotations

import base64
import struct
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.client import ModelCard
from ingress.openai.embeddings import MAX_INPUTS
from replicas.errors import ContextLengthError, InvalidRequestError
from tests.fakes import FAKE_WIDTH, FakeClient, fake_vector

CARDS = (ModelCard("orchard-embed", aliases=("embed",), capabilities=("embeddings",)),
         ModelCard("orchard-tiny"))


def sdk(fake: FakeClient) -> tuple[openai.OpenAI, TestClient]:
    http = TestClient(create_app(fake))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0), http


@pytest.mark.parametrize(("sent", "inputs"), [
    ("one text", ("one text",)),
    (["a", "bc"], ("a", "bc")),
    ([5, 6, 7], ((5, 6, 7),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
])
@pytest.mark.parametrize("encoding", ["float", "base64", None])
def test_inputs_reach_the_replica_and_vectors_come_back(sent: Any, inputs: tuple[Any, ...],
                                                        encoding: str | None) -> None:
    fake = FakeClient(models=CARDS)
    client, _ = sdk(fake)
    extra = {} if encoding is None else {"encoding_format": encoding}
    result = client.embeddings.create(model="embed", input=sent, **extra)
    (request,) = fake.embedded
    assert request.model == "orchard-embed" and request.inputs == inputs
    assert request.dimensions is None and request.request_id.startswith("emb-")
    assert result.object == "list" and result.model == "embed"
    assert [d.index for d in result.data] == list(range(len(inputs)))
    assert all(d.object == "embedding" for d in result.data)
    tokens = sum(len(x) for x in inputs)
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (tokens, tokens)
    for i, item in enumerate(result.data):
        if encoding == "base64":  # the SDK hands back the string it was asked for
            raw = base64.b64decode(item.embedding)  # type: ignore[arg-type]
            assert struct.unpack(f"<{FAKE_WIDTH}f", raw) == fake_vector(i)
        else:  # floats, or the SDK's own default: base64 on the wire, decoded by the SDK
            assert tuple(item.embedding) == fake_vector(i)


def test_base64_is_little_endian_float32_and_decodes_to_the_floats() -> None:
    _, http = sdk(FakeClient(models=CARDS))
    bodies = {fmt: http.post("/v1/embeddings", json={
        "model": "orchard-embed", "input": ["x", "y"], "encoding_format": fmt}).json()
        for fmt in ("float", "base64")}
    for floats, packed in zip(bodies["float"]["data"], bodies["base64"]["data"]):
        raw = base64.b64decode(packed["embedding"])
        assert len(raw) == 4 * FAKE_WIDTH
        assert list(struct.unpack(f"<{FAKE_WIDTH}f", raw)) == floats["embedding"]


def test_dimensions_and_user_are_passed_and_ignored() -> None:
    fake = FakeClient(models=CARDS)
    client, _ = sdk(fake)
    result = client.embeddings.create(model="orchard-embed", input="x", dimensions=2,
                                      user="someone", encoding_format="float")
    assert fake.embedded[0].dimensions == 2 and len(result.data[0].embedding) == 2


@pytest.mark.parametrize(("body", "message"), [
    ({"input": ""}, "`input` is empty"),
    ({"input": []}, "at least one input"),
    ({"input": ["a", ""]}, "`input[1]` is empty"),
    ({"input": [[1], []]}, "`input[1]` is empty"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, f"at most {MAX_INPUTS} inputs"),
    ({"input": ["a", 1]}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_a_400_before_the_replica(body: dict[str, Any], message: str) -> None:
    fake = FakeClient(models=CARDS)
    client, _ = sdk(fake)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="orchard-embed", **body)
    assert caught.value.status_code == 400 and message in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert fake.embedded == []


def test_an_unknown_model_is_a_404_naming_the_served_ones() -> None:
    client, _ = sdk(FakeClient(models=CARDS))
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="nope", input="x")
    assert "orchard-embed" in caught.value.message


@pytest.mark.parametrize(("error", "status", "code"), [
    (InvalidRequestError("model 'orchard-tiny' does not serve embeddings: ...", param="model"),
     400, "invalid_request"),
    (ContextLengthError("input has 9000 tokens; this model embeds at most 2048",
                        param="input"), 400, "context_length_exceeded"),
])
def test_the_replica_s_refusals_keep_their_status(error: Exception, status: int,
                                                  code: str) -> None:
    _, http = sdk(FakeClient(models=CARDS, embed_error=error))  # type: ignore[arg-type]
    response = http.post("/v1/embeddings", json={"model": "orchard-tiny", "input": "x"})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["param"] in ("model", "input")


def test_models_say_what_each_model_does() -> None:
    _, http = sdk(FakeClient(models=CARDS))
    listed = {m["id"]: m["capabilities"] for m in http.get("/v1/models").json()["data"]}
    assert listed == {"orchard-embed": ["embeddings"], "embed": ["embeddings"],
                      "orchard-tiny": ["text"]}
