"""The edge over real HTTP with the real model: context limits and API keys from the
environment (the keys the cluster was started with)."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.cluster import API_KEY, CONTEXT_LENGTH, SOLO, auth_headers
from tests.reliability.wire import anthropic_message, openai_chat

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def http(cluster: str) -> httpx.Client:
    return httpx.Client(base_url=cluster, headers=auth_headers(), timeout=60)


def test_max_tokens_past_the_context_is_clamped_and_said(http: httpx.Client) -> None:
    too_many = CONTEXT_LENGTH * 2
    chat = http.post("/v1/chat/completions",
                     json=openai_chat(SOLO.model, stream=False, max_tokens=too_many))
    assert chat.status_code == 200, chat.text
    [warning] = chat.json()["orchard_warnings"]
    assert warning.startswith(f"max_tokens lowered from {too_many} to ")
    assert f"of this model's {CONTEXT_LENGTH}-token context" in warning

    # Anthropic without `thinking` renders with thinking off: a script trained that way.
    message = http.post("/v1/messages", json=anthropic_message(
        SOLO.model, stream=False, max_tokens=too_many, sid="riddle-nothink"))
    assert message.status_code == 200, message.text
    assert message.json()["orchard_warnings"][0].startswith(f"max_tokens lowered from {too_many}")


def test_a_prompt_past_the_context_is_a_400(http: httpx.Client) -> None:
    long_prompt = http.post("/v1/completions", json={
        "model": SOLO.model, "prompt": [1] * (CONTEXT_LENGTH + 10), "max_tokens": 1})
    assert long_prompt.status_code == 400
    error = long_prompt.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT_LENGTH} tokens" in error["message"]

    message = http.post("/v1/messages", json={
        "model": SOLO.model, "max_tokens": 8,
        "messages": [{"role": "user", "content": "word " * (CONTEXT_LENGTH * 2)}]})
    assert message.status_code == 400
    body = message.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "maximum context length" in body["error"]["message"]


def test_api_key_is_required_except_for_health(cluster: str) -> None:
    with httpx.Client(base_url=cluster, timeout=60) as anonymous:
        assert anonymous.get("/health").status_code == 200
        openai = anonymous.post("/v1/chat/completions", json=openai_chat(SOLO.model, stream=False))
        assert openai.status_code == 401
        assert openai.json()["error"]["type"] == "authentication_error"
        anthropic = anonymous.post("/v1/messages", json=anthropic_message(SOLO.model, stream=False),
                                   headers={"x-api-key": "wrong"})
        assert anthropic.status_code == 401
        assert anthropic.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid API key"}}
        assert "wrong" not in anthropic.text
        ok = anonymous.post("/v1/messages", json=anthropic_message(SOLO.model, stream=False),
                            headers={"x-api-key": API_KEY})
        assert ok.status_code == 200, ok.text
