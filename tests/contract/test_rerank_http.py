"""`POST /v1/rerank` (and `/rerank`, `/v2/rerank`) over raw HTTP against the real app and a
fake client (no SDK has rerank): the request the replica gets, ordering, `top_n`,
`return_documents`, and the 400s and 404 the edge answers before any replica time."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.client import ModelCard
from ingress.openai.rerank import MAX_DOCUMENTS
from replicas.errors import ContextLengthError, InvalidRequestError
from tests.fakes import FakeClient, fake_score

CARDS = (ModelCard("orchard-rerank", aliases=("rr",), capabilities=("text", "rerank")),
         ModelCard("orchard-tiny"))
QUERY = "weather in paris"
DOCS = ["tokyo is large", "the weather in paris is sunny", "paris in spring",
        "weather report", "paris weather"]


def post(body: dict[str, Any], path: str = "/v1/rerank",
         fake: FakeClient | None = None) -> tuple[Any, FakeClient]:
    fake = fake or FakeClient(models=CARDS)
    http = TestClient(create_app(fake))
    return http.post(path, json=body), fake


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_results_sorted_by_score_with_documents(path: str) -> None:
    response, fake = post({"model": "rr", "query": QUERY,
                           "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]}, path)
    assert response.status_code == 200, response.text
    body = response.json()
    (request,) = fake.reranked
    assert request.model == "orchard-rerank" and request.query == QUERY
    assert request.documents == tuple(DOCS) and request.max_tokens_per_doc is None
    assert body["id"] == request.request_id and body["id"].startswith("rerank-")
    assert body["model"] == "rr"
    scores = [fake_score(QUERY, d) for d in DOCS]
    want = sorted(range(len(DOCS)), key=lambda i: (-scores[i], i))
    assert [r["index"] for r in body["results"]] == want
    assert [r["relevance_score"] for r in body["results"]] == [scores[i] for i in want]
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in want]
    assert body["usage"] == {"total_tokens": sum(len(QUERY) + len(d) for d in DOCS)}
    # ties keep request order: "paris in spring" and "paris weather" both hold 2/3
    assert want == [1, 2, 4, 3, 0]


@pytest.mark.parametrize(("top_n", "count"), [(1, 1), (3, 3), (5, 5), (50, 5)])
def test_top_n_keeps_the_best(top_n: int, count: int) -> None:
    response, _ = post({"model": "rr", "query": QUERY, "documents": DOCS, "top_n": top_n,
                        "return_documents": False})
    results = response.json()["results"]
    assert [r["index"] for r in results] == [1, 2, 4, 3, 0][:count]
    assert all("document" not in r for r in results)


def test_options_reach_the_replica() -> None:
    _, fake = post({"model": "orchard-rerank", "query": QUERY, "documents": DOCS,
                    "max_tokens_per_doc": 7, "instruction": "Find weather reports",
                    "rank_fields": ["text"]})
    (request,) = fake.reranked
    assert request.max_tokens_per_doc == 7 and request.instruction == "Find weather reports"


@pytest.mark.parametrize(("body", "param"), [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": "", "documents": DOCS}, "query"),
    ({"query": "  ", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": -2}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
    ({"query": QUERY, "documents": ["x"] * (MAX_DOCUMENTS + 1)}, "documents"),
])
def test_bad_shapes_are_openai_400s(body: dict[str, Any], param: str) -> None:
    response, fake = post({"model": "rr", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fake.reranked == []


@pytest.mark.parametrize("body", [
    {"model": "rr", "documents": DOCS},  # no query
    {"model": "rr", "query": QUERY, "documents": [{"title": "no text"}]},
    {"model": "rr", "query": QUERY, "documents": "one string"},
])
def test_malformed_bodies_are_400s(body: dict[str, Any]) -> None:
    response, fake = post(body)
    assert response.status_code == 400 and "error" in response.json()
    assert fake.reranked == []


def test_unknown_model_is_404() -> None:
    response, _ = post({"model": "nope", "query": QUERY, "documents": DOCS})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("error", [
    InvalidRequestError("model 'orchard-tiny' does not rerank: ...", param="model"),
    ContextLengthError("documents[0] with the query is 9000 tokens", param="documents"),
])
def test_replica_refusals_are_400s(error: Exception) -> None:
    fake = FakeClient(models=CARDS, embed_error=error)  # type: ignore[arg-type]
    response, _ = post({"model": "orchard-tiny", "query": QUERY, "documents": DOCS},
                       fake=fake)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == str(error)


def test_a_rerank_is_recorded_with_its_tokens() -> None:
    from ingress.observe import RequestRecord
    from replicas.contract import ErrorKind, Usage

    class Collect:
        def __init__(self) -> None:
            self.records: list[RequestRecord] = []

        def request_finished(self, record: RequestRecord) -> None:
            self.records.append(record)

    seen = Collect()
    http = TestClient(create_app(FakeClient(models=CARDS), observer=seen))
    assert http.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS}
                     ).status_code == 200
    refused = FakeClient(models=CARDS, embed_error=InvalidRequestError("no", param="model"))
    failed = Collect()
    assert TestClient(create_app(refused, observer=failed)).post("/v1/rerank", json={
        "model": "rr", "query": QUERY, "documents": DOCS}).status_code == 400
    (record,) = seen.records
    assert (record.protocol, record.endpoint, record.status) == ("openai", "/v1/rerank", 200)
    assert record.model == "orchard-rerank" and record.request_id is not None
    assert record.request_id.startswith("rerank-") and record.error is None
    tokens = sum(len(QUERY) + len(d) for d in DOCS)
    assert record.usage == Usage(prompt_tokens=tokens, completion_tokens=0)
    assert failed.records[0].status == 400
    assert failed.records[0].error is ErrorKind.INVALID_REQUEST
