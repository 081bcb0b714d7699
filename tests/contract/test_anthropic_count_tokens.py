"""The Anthropic Messages adapter's count_tokens endpoint."""

from __future__ import annotations

from replicas.contract import ChatMessage, ChatPrompt, ReasoningSpec
from tests.contract.anthropic_wire import MODEL, USER, http


def test_count_tokens() -> None:
    client, fake = http(input_tokens=42)
    response = client.post(
        "/v1/messages/count_tokens",
        json={
            "model": MODEL,
            "system": "Be brief.",
            "messages": USER,
            "thinking": {"type": "enabled", "budget_tokens": 2048},
        },
    )
    assert response.status_code == 200 and response.json() == {"input_tokens": 42}
    (counted,) = fake.counted
    assert counted.prompt == ChatPrompt(
        (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"))
    )
    assert counted.reasoning == ReasoningSpec(enabled=True, budget_tokens=2048)
    assert fake.requests == []


def test_count_tokens_validates_like_messages() -> None:
    client, _ = http()
    response = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
    assert (
        response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    )
