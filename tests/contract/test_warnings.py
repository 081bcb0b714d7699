"""What the server changed about a request (a clamped max_tokens) reaches the client in
every API, as the top-level `orchard_warnings` list, streamed and not."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.protocol import WARNINGS_FIELD
from replicas.contract import Channel, Finished, FinishReason, TextDelta, Usage
from tests.fakes import FakeClient

WARNING = "max_tokens lowered from 32000 to 7: the prompt has 25 tokens of this model's 32-token context"
SCRIPT = [TextDelta(Channel.ANSWER, "Hi"),
          Finished(FinishReason.LENGTH, Usage(25, 7), warnings=(WARNING,))]


@pytest.fixture()
def http() -> TestClient:
    return TestClient(create_app(FakeClient(SCRIPT)))


def test_openai_chat(http: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
    body = client.chat.completions.with_raw_response.create(
        model="orchard-tiny", max_tokens=32000,
        messages=[{"role": "user", "content": "Hi"}]).http_response.json()
    assert body[WARNINGS_FIELD] == [WARNING] and body["choices"][0]["finish_reason"] == "length"
    finals = [c for c in client.chat.completions.create(
        model="orchard-tiny", max_tokens=32000, stream=True,
        messages=[{"role": "user", "content": "Hi"}]) if c.choices and c.choices[0].finish_reason]
    assert [getattr(c, WARNINGS_FIELD) for c in finals] == [[WARNING]]


def test_anthropic_messages(http: TestClient) -> None:
    client = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http)
    raw = client.messages.with_raw_response.create(
        model="orchard-tiny", max_tokens=20000, messages=[{"role": "user", "content": "Hi"}])
    body = raw.http_response.json()
    assert body[WARNINGS_FIELD] == [WARNING] and body["stop_reason"] == "max_tokens"
    with http.stream("POST", "/v1/messages", json={
            "model": "orchard-tiny", "max_tokens": 32000, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as response:
        deltas = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and '"message_delta"' in line]
    assert [d[WARNINGS_FIELD] for d in deltas] == [[WARNING]]


def test_responses(http: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
    raw = client.responses.with_raw_response.create(model="orchard-tiny", input="Hi",
                                                    max_output_tokens=32000)
    body: dict[str, Any] = raw.http_response.json()
    assert body[WARNINGS_FIELD] == [WARNING] and body["status"] == "incomplete"
