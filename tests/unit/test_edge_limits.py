"""Size limits at the edge: each is refused before the request reaches a replica."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.options import EdgeOptions
from replicas.contract import Channel, Finished, FinishReason, OutputEvent, TextDelta, Usage
from tests.fakes import FakeClient

ANSWER: list[OutputEvent] = [TextDelta(Channel.ANSWER, "Hi"),
                             Finished(FinishReason.EOS, Usage(3, 1))]
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_PATH, MESSAGES_PATH = "/v1/chat/completions", "/v1/messages"


def edge(**options: Any) -> tuple[TestClient, FakeClient]:
    fake = FakeClient(ANSWER)
    return TestClient(create_app(fake, EdgeOptions(**options))), fake


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "orchard-tiny", "messages": MESSAGES, **extra}


def message(**extra: Any) -> dict[str, Any]:
    return {"model": "orchard-tiny", "max_tokens": 8, "messages": MESSAGES, **extra}


@pytest.mark.parametrize(("path", "body"), [
    (CHAT_PATH, chat()), (MESSAGES_PATH, message()),
    ("/v1/responses", {"model": "orchard-tiny", "input": "hi"}),
])
def test_a_body_over_the_limit_is_a_413_in_the_protocols_shape(path: str, body: Any) -> None:
    http, fake = edge(max_body_bytes=2048)
    padded = {**body, "user": "x" * 4096}
    response = http.post(path, json=padded)
    assert response.status_code == 413
    error = response.json()["error"]
    if path == MESSAGES_PATH:
        assert error["type"] == "request_too_large"
    else:
        assert error["code"] == "request_too_large"
    assert "2048 bytes" in error["message"]
    assert fake.requests == []


def test_a_chunked_body_without_a_length_is_cut_off_at_the_limit() -> None:
    http, fake = edge(max_body_bytes=2048)

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "orchard-tiny", "messages": [], "user": "'
        for _ in range(64):
            yield b"x" * 256
        yield b'"}'

    response = http.post(CHAT_PATH, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and fake.requests == []


def test_a_body_within_the_limit_is_served() -> None:
    http, fake = edge(max_body_bytes=2048)
    body = json.dumps(chat(user="x" * 1500)).encode()
    assert len(body) <= 2048
    response = http.post(CHAT_PATH, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and len(fake.requests) == 1


@pytest.mark.parametrize(("path", "body"), [
    (CHAT_PATH, chat(stop=[f"s{i}" for i in range(5)])),
    (CHAT_PATH, chat(stop=["a", "b"], stop_token_ids=[1, 2, 3])),
    (MESSAGES_PATH, message(stop_sequences=[f"s{i}" for i in range(5)])),
    (CHAT_PATH, chat(stop="y" * 33)),
    (MESSAGES_PATH, message(stop_sequences=["z" * 33])),
    (CHAT_PATH, chat(n=9)),  # past MAX_CHOICES (8): each choice is a whole generation
])
def test_stop_count_stop_length_and_n_are_capped_before_any_replica_time(
    path: str, body: dict[str, Any]
) -> None:
    http, fake = edge(max_stops=4, max_stop_chars=32)
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert fake.requests == []


def test_stops_at_the_limits_are_served() -> None:
    http, fake = edge(max_stops=4, max_stop_chars=32)
    response = http.post(CHAT_PATH, json=chat(stop=["a" * 32, "b"], stop_token_ids=[1, 2]))
    assert response.status_code == 200 and len(fake.requests) == 1


def test_default_caps() -> None:
    options = EdgeOptions()
    assert (options.max_body_bytes, options.max_stops, options.max_stop_chars) == (32 << 20, 16, 256)
