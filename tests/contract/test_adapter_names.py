"""LoRA adapters at the edge (`ingress.client.require_model`), against the real app and a
fake client: `BASE:NAME` and an alias of the pair reach the replica as the base model with
that adapter, in every generating API; `/v1/models` lists each adapter; an adapter the
model does not serve is a 400 in each API's shape, a model not served at all still a 404."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import Channel, FinishReason, Finished, TextDelta, Usage
from tests.fakes import FakeClient

CARDS = (ModelCard("orchard-tiny", aliases=("tiny",), adapters=("sql", "poet"),
                   adapter_aliases=(("sql-bot", "sql"),)),
         ModelCard("other"))
SCRIPT = [TextDelta(Channel.ANSWER, "ok"), Finished(FinishReason.EOS, Usage(1, 1))]
CHAT = [{"role": "user", "content": "Hi"}]


def post(path: str, body: dict[str, Any]) -> tuple[Any, FakeClient]:
    fake = FakeClient(SCRIPT, models=CARDS)
    return TestClient(create_app(fake)).post(path, json=body), fake


def bodies(model: str) -> list[tuple[str, dict[str, Any]]]:
    return [("/v1/chat/completions", {"model": model, "messages": CHAT}),
            ("/v1/completions", {"model": model, "prompt": "Hi"}),
            ("/v1/messages", {"model": model, "max_tokens": 4, "messages": CHAT}),
            ("/v1/responses", {"model": model, "input": "Hi"})]


@pytest.mark.parametrize("model,adapter", [("orchard-tiny:sql", "sql"),
                                           ("tiny:poet", "poet"), ("sql-bot", "sql"),
                                           ("orchard-tiny", None), ("tiny", None)])
def test_the_adapter_reaches_the_replica(model: str, adapter: str | None) -> None:
    for path, body in bodies(model):
        response, fake = post(path, body)
        assert response.status_code == 200, (path, response.text)
        (request,) = fake.requests
        assert (request.model, request.adapter) == ("orchard-tiny", adapter), path


def test_models_lists_every_adapter() -> None:
    http = TestClient(create_app(FakeClient(models=CARDS)))
    listed = {m["id"]: m["root"] for m in http.get("/v1/models").json()["data"]}
    assert listed == {"orchard-tiny": "orchard-tiny", "tiny": "orchard-tiny",
                      "orchard-tiny:sql": "orchard-tiny", "orchard-tiny:poet": "orchard-tiny",
                      "sql-bot": "orchard-tiny", "other": "other"}
    one = http.get("/v1/models/orchard-tiny:sql").json()
    assert (one["id"], one["root"]) == ("orchard-tiny:sql", "orchard-tiny")


@pytest.mark.parametrize("path,body", bodies("orchard-tiny:nope"))
def test_an_unknown_adapter_is_a_400(path: str, body: dict[str, Any]) -> None:
    response, fake = post(path, body)
    assert response.status_code == 400, response.text
    assert fake.requests == []
    error = response.json()
    if path == "/v1/messages":  # Anthropic's shape
        assert error["type"] == "error"
        error = error["error"]
        assert error["type"] == "invalid_request_error"
    else:
        error = error["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "model"
    assert "no adapter 'nope'" in error["message"] and "sql, poet" in error["message"]


def test_a_model_with_no_adapters_and_an_unknown_model() -> None:
    response, _ = post("/v1/completions", {"model": "other:sql", "prompt": "Hi"})
    assert response.status_code == 400 and "adapters: none" in response.text
    response, _ = post("/v1/completions", {"model": "nowhere:sql", "prompt": "Hi"})
    assert response.status_code == 404
