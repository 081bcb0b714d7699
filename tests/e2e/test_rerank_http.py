"""`POST /v1/rerank` over a real `serve run` on loopback, with httpx (no official SDK has
rerank): `builtin:rerank` (a Qwen3-Reranker-style decoder, `kind: rerank`) and
`builtin:cross-encoder` (mlx-embeddings' ModernBERT with its classification head), served
by the shared app beside `orchard-tiny` (a chat model, no reranker) through the Ray
handle client.

Scores are checked against the libraries' own forward run in this process on the same
built files (mlx-lm's model call on Qwen3-Reranker's template; mlx-embeddings' model on
the tokenizer's pair encoding); ordering, `top_n`, `return_documents`, the three paths,
`/v1/models` and the 400s (after which the server keeps serving) over HTTP.
"""

from __future__ import annotations

from typing import Any

import httpx
import mlx.core as mx
import pytest

from replicas.builtin import ensure_builtin
from replicas.sources import load_source
from tests.integration.test_rerank_replica import INSTRUCTION, PREFIX, SUFFIX
from tests.observability.test_observability_http import App

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4  # max abs difference from the in-process forward
MODELS = [
    {"id": "orchard-rerank", "source": "builtin:rerank", "kind": "rerank",
     "max_ongoing_requests": 16},
    {"id": "orchard-cross-encoder", "source": "builtin:cross-encoder",
     "max_ongoing_requests": 16},
]
QUERY = "What is the weather in Paris?"
DOCS = ["The weather in Paris is sunny.", "hi", "Paris", "It is raining in Rome today.",
        "Tokyo, Delhi and Shanghai are large cities with many people living in them."]


@pytest.fixture(scope="module")
def http(shared_app: App) -> Any:
    """MODELS, served with the other modules' models by one app (conftest)."""
    with httpx.Client(base_url=shared_app.serve.base_url, timeout=120) as client:
        yield client


def decoder_reference(docs: list[str]) -> list[float]:
    model = load_source("builtin:rerank")
    tok = model.hf_tokenizer
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    out = []
    for doc in docs:
        row = (tok.encode(PREFIX, add_special_tokens=False)
               + tok.encode(f"<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}",
                            add_special_tokens=False)
               + tok.encode(SUFFIX, add_special_tokens=False))
        logits = model.model(mx.array([row]))[0, -1].astype(mx.float32)
        out.append(mx.softmax(mx.stack([logits[no], logits[yes]]))[1].item())
    return out


def cross_reference(docs: list[str]) -> list[float]:
    from mlx_embeddings.utils import load_model
    from transformers import AutoTokenizer

    path = ensure_builtin("cross-encoder")
    encoder, tok = load_model(path), AutoTokenizer.from_pretrained(str(path))
    rows = tok([QUERY] * len(docs), docs)["input_ids"]
    return [encoder(mx.array([r])).pooler_output[0, 0].item() for r in rows]


def post(http: httpx.Client, path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    return http.post(path, json={"query": QUERY, "documents": DOCS, **body})


@pytest.mark.parametrize(("model", "reference"), [("orchard-rerank", decoder_reference),
                                                  ("orchard-cross-encoder", cross_reference)])
def test_scores_are_the_library_forward_sorted(http: httpx.Client, model: str,
                                               reference: Any) -> None:
    response = post(http, model=model)
    assert response.status_code == 200, response.text
    body = response.json()
    want = reference(DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert body["model"] == model and body["id"].startswith("rerank-")
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) <= TOLERANCE
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_top_n_without_documents_on_every_path(http: httpx.Client, path: str) -> None:
    full = post(http, model="orchard-rerank").json()["results"]
    response = post(http, path, model="orchard-rerank", top_n=2, return_documents=False,
                    documents=[DOCS[0], {"text": DOCS[1]}, *DOCS[2:]])
    assert response.status_code == 200, response.text
    top = response.json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert all("document" not in r for r in top)


def test_models_list_the_rerankers(http: httpx.Client) -> None:
    listed = {m["id"]: m["capabilities"] for m in http.get("/v1/models").json()["data"]}
    assert listed["orchard-rerank"] == ["text", "rerank"]
    assert listed["orchard-cross-encoder"] == ["rerank"]
    assert "rerank" not in listed["orchard-tiny"]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"model": "orchard-tiny"}, "model", "does not rerank"),
    ({"model": "orchard-rerank", "documents": []}, "documents", "at least one"),
    ({"model": "orchard-rerank", "query": ""}, "query", "must not be empty"),
    ({"model": "orchard-rerank", "top_n": 0}, "top_n", "at least 1"),
    ({"model": "orchard-rerank", "documents": ["word " * 5000]}, "documents", "at most"),
    ({"model": "orchard-cross-encoder", "documents": ["word " * 600]}, "documents",
     "at most"),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(
        http: httpx.Client, body: dict[str, Any], param: str, says: str) -> None:
    response = post(http, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert post(http, model=body["model"] if body["model"] != "orchard-tiny"
                else "orchard-rerank").status_code == 200
