"""Tenants at the door (the real app, a fake model client): each key's tenant, its limits
as 429s in each API's shape with `Retry-After`, OpenAI's `x-ratelimit-*` headers, allowed
models, the priority a request may lower, usage and `GET /v1/usage`; the official SDKs
raise their own `RateLimitError`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from deployments.config import AppArgs
from deployments.ingress_deployment import EdgeArgs
from ingress.app import create_app
from ingress.client import ModelCard
from ingress.options import EdgeOptions
from ingress.tenancy.ledger import Ledger
from ingress.tenancy.policy import TenantPolicy
from replicas.contract import Channel, Finished, FinishReason, OutputEvent, TextDelta, Usage
from replicas.errors import RateLimitedError
from tests.fakes import FakeClient

CI, AGENT, ADMIN = "sk-ci-0123456789", "sk-agent-0123456789", "sk-admin-0123456789"
ANSWER: list[OutputEvent] = [TextDelta(Channel.ANSWER, "Hi"), TextDelta(Channel.ANSWER, "!"),
                             Finished(FinishReason.EOS, Usage(30, 2, cached_tokens=4,
                                                              preemptions=0))]
CHAT = {"model": "orchard-tiny", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello"}]}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/messages", CHAT),
          ("/v1/responses", {"model": "orchard-tiny", "input": "hello"})]

TENANTS = (
    TenantPolicy("ci", frozenset({CI}), priority=5, share=1, max_concurrent=4,
                 tokens_per_minute=60, models=frozenset({"tiny"})),
    TenantPolicy("agents", frozenset({AGENT}), priority=0, share=3),
    TenantPolicy("ops", frozenset({ADMIN}), admin=True),
)


def app(fake: FakeClient | None = None) -> tuple[TestClient, FakeClient]:
    fake = fake or FakeClient(ANSWER)
    return TestClient(create_app(fake, EdgeOptions(tenants=TENANTS))), fake


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def test_a_key_in_no_tenant_is_a_401() -> None:
    client, _ = app()
    for key in ("sk-unknown-0123456789", None):
        headers = auth(key) if key else {}
        response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/health").status_code == 200


def test_the_tenancy_reaches_the_replica_and_priority_only_lowers() -> None:
    client, fake = app()
    client.post("/v1/chat/completions", json=CHAT, headers=auth(AGENT))
    client.post("/v1/chat/completions", json={**CHAT, "priority": 7}, headers=auth(AGENT))
    client.post("/v1/messages", json=CHAT, headers=auth(CI, **{"x-orchard-priority": "-3"}))
    client.post("/v1/messages", json=CHAT, headers=auth(CI, **{"x-orchard-priority": "9"}))
    tenancies = [(r.tenancy.tenant, r.tenancy.priority, r.tenancy.share) for r in fake.requests]
    assert tenancies == [("agents", 0, 3), ("agents", 7, 3), ("ci", 5, 1), ("ci", 9, 1)]
    bad = client.post("/v1/messages", json=CHAT, headers=auth(CI, **{"x-orchard-priority": "x"}))
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_a_model_outside_the_tenant_is_not_found() -> None:
    fake = FakeClient(ANSWER, models=(ModelCard("orchard-tiny", aliases=("tiny",)),
                                      ModelCard("big")))
    client, _ = app(fake)
    assert client.post("/v1/chat/completions", json=CHAT, headers=auth(CI)).status_code == 200
    refused = client.post("/v1/chat/completions", json={**CHAT, "model": "big"},
                          headers=auth(CI))
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    ok = client.post("/v1/chat/completions", json={**CHAT, "model": "big"}, headers=auth(AGENT))
    assert ok.status_code == 200


def test_the_tokenizer_routes_keep_to_the_tenants_models() -> None:
    """`/tokenize` (prompt or messages), `/detokenize`, `/tokenizer_info` and Anthropic's
    count_tokens refuse a model outside the tenant exactly as chat does: 404, the same
    error body; inside it, or for a tenant with no list, they answer."""
    fake = FakeClient(ANSWER, models=(ModelCard("orchard-tiny", aliases=("tiny",)),
                                      ModelCard("big")))
    client, _ = app(fake)
    chat = client.post("/v1/chat/completions", json={**CHAT, "model": "big"}, headers=auth(CI))
    assert chat.status_code == 404
    calls = [("POST", "/tokenize", {"model": "big", "prompt": "hello"}),
             ("POST", "/tokenize", {"model": "big", "messages": CHAT["messages"]}),
             ("POST", "/detokenize", {"model": "big", "tokens": [1, 2]}),
             ("GET", "/tokenizer_info?model=big", None)]
    for method, path, body in calls:
        refused = client.request(method, path, json=body, headers=auth(CI))
        assert refused.status_code == 404, (path, refused.text)
        assert refused.json() == chat.json(), path
        assert client.request(method, path, json=body,
                              headers=auth(AGENT)).status_code == 200, path
        inside = path.replace("big", "tiny")
        assert client.request(method, inside, json=body and {**body, "model": "tiny"},
                              headers=auth(CI)).status_code == 200, path
    assert len(fake.counted) == 4  # the refused never left the edge
    messages = client.post("/v1/messages", json={**CHAT, "model": "big"}, headers=auth(CI))
    count = client.post("/v1/messages/count_tokens", json={**CHAT, "model": "big"},
                        headers=auth(CI))
    assert messages.status_code == count.status_code == 404
    assert count.json() == messages.json()


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_tokens_per_minute_is_a_429_in_each_shape(path: str, body: dict[str, Any]) -> None:
    client, _ = app()
    ledger: Ledger = client.app.state.ledger  # type: ignore[attr-defined]
    now = [1000.0]
    ledger._clock = lambda: now[0]
    first = client.post(path, json=body, headers=auth(CI))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "60"
    client.post(path, json=body, headers=auth(CI))  # 64 tokens spent: past 60
    now[0] += 10
    refused = client.post(path, json=body, headers=auth(CI))
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "50"  # the first request's tokens leave then
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    if path == "/v1/messages":
        assert refused.json() == {"type": "error", "error": {
            "type": "rate_limit_error", "message": refused.json()["error"]["message"]}}
    else:
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    now[0] += 50
    assert client.post(path, json=body, headers=auth(CI)).status_code == 200
    # Another tenant is not held back by it.
    assert client.post(path, json=body, headers=auth(AGENT)).status_code == 200


def test_concurrent_requests_past_the_limit_are_refused() -> None:
    client, _ = app()
    ledger: Ledger = client.app.state.ledger  # type: ignore[attr-defined]
    for _ in range(4):
        ledger.enter(TENANTS[0])  # four streams of `ci` in flight
    refused = client.post("/v1/chat/completions", json=CHAT, headers=auth(CI))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    ledger.leave("ci")
    response = client.post("/v1/chat/completions", json=CHAT, headers=auth(CI))
    assert response.status_code == 200
    assert response.headers["x-ratelimit-limit-requests"] == "4"


def test_the_window_slides() -> None:
    now = [0.0]
    ledger = Ledger(lambda: now[0])
    ledger.spend("ci", 5)
    now[0] = 20.0
    ledger.spend("ci", 57)
    with pytest.raises(RateLimitedError) as refused:
        ledger.enter(TENANTS[0])  # 62 of 60: the 5 leave at 60s, which is enough
    assert refused.value.retry_after_s == pytest.approx(40.0)
    now[0] = 60.0
    ledger.enter(TENANTS[0])


def test_the_official_sdks_raise_rate_limit_error() -> None:
    client, _ = app()
    ledger: Ledger = client.app.state.ledger  # type: ignore[attr-defined]
    for _ in range(4):
        ledger.enter(TENANTS[0])
    oai = openai.OpenAI(api_key=CI, base_url="http://testserver/v1", http_client=client,
                        max_retries=0)
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model="orchard-tiny", messages=[{"role": "user",
                                                                     "content": "hi"}])
    with pytest.raises(openai.RateLimitError):
        oai.responses.create(model="orchard-tiny", input="hi")
    claude = anthropic.Anthropic(api_key=CI, base_url="http://testserver", http_client=client,
                                 max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as error:
        claude.messages.create(model="orchard-tiny", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_usage_is_counted_per_tenant_and_model_for_admins_only() -> None:
    client, _ = app()
    client.post("/v1/chat/completions", json=CHAT, headers=auth(AGENT))
    client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth(AGENT))
    client.post("/v1/messages", json=CHAT, headers=auth(CI))
    assert client.get("/v1/usage", headers=auth(AGENT)).status_code == 403
    report = client.get("/v1/usage", headers=auth(ADMIN))
    assert report.status_code == 200
    rows = {row["tenant"]: row for row in report.json()["data"]}
    assert rows["agents"] == {"tenant": "agents", "model": "orchard-tiny", "requests": 2,
                              "prompt_tokens": 60, "cached_tokens": 8, "completion_tokens": 4,
                              "preemptions": 0}
    assert rows["ci"]["requests"] == 1


def test_without_tenants_nothing_changes() -> None:
    fake = FakeClient(ANSWER)
    client = TestClient(create_app(fake, EdgeOptions()))
    response = client.post("/v1/chat/completions", json={**CHAT, "priority": 3})
    assert response.status_code == 200
    assert not any(h.startswith("x-ratelimit") for h in response.headers)
    assert fake.requests[0].tenancy.tenant == "default"
    assert fake.requests[0].tenancy.priority == 0  # no tenant: nothing to schedule by
    assert client.get("/v1/usage").status_code == 404


def test_config_reads_keys_from_the_environment_never_the_file(
        caplog: pytest.LogCaptureFixture) -> None:
    config = AppArgs.model_validate({
        "models": [{"id": "orchard-tiny", "source": "builtin:tiny"}],
        "tenants": {"ci": {"keys_env": "CI_KEYS", "priority": 5, "share": 1,
                           "max_concurrent": 4, "tokens_per_minute": 1000,
                           "models": ["orchard-tiny"]},
                    "agents": {"keys_env": "AGENT_KEYS", "share": 3, "admin": True}}})
    caplog.set_level(logging.DEBUG)
    options = EdgeArgs.from_config(config).options({"CI_KEYS": f"{CI}, sk-ci-2",
                                                    "AGENT_KEYS": AGENT})
    by_name = {t.name: t for t in options.tenants}
    assert by_name["ci"].keys == {CI, "sk-ci-2"} and by_name["ci"].priority == 5
    assert by_name["ci"].models == {"orchard-tiny"} and by_name["agents"].admin
    assert CI not in repr(options) and CI not in repr(by_name["ci"])
    with pytest.raises(ValueError, match="AGENT_KEYS"):
        EdgeArgs.from_config(config).options({"CI_KEYS": CI})
    with pytest.raises(ValueError):
        AppArgs.model_validate({"models": [{"id": "m", "source": "builtin:tiny"}],
                                "tenants": {"ci": {"keys": ["sk-in-the-file"]}}})


def test_usage_store_adds_up() -> None:
    from ingress.tenancy.usage import MemoryUsageStore, UsageCounts

    async def run() -> dict[Any, UsageCounts]:
        store = MemoryUsageStore()
        await store.add("a", "m", UsageCounts(1, 10, 2, 5))
        await store.add("a", "m", UsageCounts(1, 1, 0, 1))
        return await store.report()

    assert asyncio.run(run()) == {("a", "m"): UsageCounts(2, 11, 2, 6)}


def test_a_key_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    client, _ = app()
    with caplog.at_level(logging.DEBUG):
        client.post("/v1/chat/completions", json=CHAT, headers=auth(AGENT))
        client.post("/v1/chat/completions", json=CHAT, headers=auth("sk-stranger-0123456789"))
        for _ in range(5):  # past `ci`'s tokens per minute: a 429 names the tenant only
            client.post("/v1/messages", json=CHAT, headers={"x-api-key": CI})
    for key in (AGENT, CI, "sk-stranger-0123456789"):
        assert key not in caplog.text
    assert CI not in repr(client.app.state.tenants)  # type: ignore[attr-defined]


def test_embeddings_and_rerank_keep_to_the_tenants_models_and_limits() -> None:
    """Not only generation: a model outside the tenant is a 404 on `/v1/embeddings` and
    `/v1/rerank` too, their prompt tokens count against its minute, and their usage."""
    fake = FakeClient(ANSWER, models=(ModelCard("orchard-tiny", aliases=("tiny",)),
                                      ModelCard("big")))
    client, _ = app(fake)
    calls = [("/v1/embeddings", {"input": ["abcdefghij" * 3]}),
             ("/v1/rerank", {"query": "q", "documents": ["a" * 29]})]
    for path, body in calls:
        refused = client.post(path, json={**body, "model": "big"}, headers=auth(CI))
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["param"] == "model"
        assert client.post(path, json={**body, "model": "big"},
                           headers=auth(AGENT)).status_code == 200
    assert len(fake.embedded) == len(fake.reranked) == 1  # the refused never left the edge
    for path, body in calls:  # 30 tokens each (the fake counts characters)
        assert client.post(path, json={**body, "model": "tiny"},
                           headers=auth(CI)).status_code == 200
    over = client.post("/v1/embeddings", json={"model": "tiny", "input": "x"}, headers=auth(CI))
    assert over.status_code == 429 and "60 per minute" in over.json()["error"]["message"]
    rows = {(r["tenant"], r["model"]): r for r in
            client.get("/v1/usage", headers=auth(ADMIN)).json()["data"]}
    assert rows[("ci", "orchard-tiny")]["requests"] == 2
    assert rows[("ci", "orchard-tiny")]["prompt_tokens"] == 60
