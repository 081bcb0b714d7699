"""Images, documents and files on a text-only model, through the official SDKs: the part is
left out for a placeholder the template renders, the model answers, and the response
warns in `orchard_warnings` and the `x-orchard-warning` header, streamed and not."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.media import placeholder
from ingress.protocol import WARNING_HEADER, WARNINGS_FIELD
from replicas.contract import Channel, ChatMessage, Finished, FinishReason, TextDelta, Usage
from tests.fakes import FakeClient

MODEL = "orchard-tiny"
SCRIPT = [TextDelta(Channel.ANSWER, "A cat."), Finished(FinishReason.EOS, Usage(9, 3))]
IMAGE = placeholder("image")
PNG = {"type": "base64", "media_type": "image/png", "data": "AA=="}


def app() -> tuple[FakeClient, TestClient]:
    fake = FakeClient(SCRIPT)
    return fake, TestClient(create_app(fake))


def openai_sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


def anthropic_sdk(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http,
                               max_retries=0)


def test_openai_chat_image_url_part() -> None:
    fake, http = app()
    messages: Any = [{"role": "user", "content": [
        {"type": "text", "text": "What is this? "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    raw = openai_sdk(http).chat.completions.with_raw_response.create(model=MODEL,
                                                                      messages=messages)
    body = raw.http_response.json()
    assert body["choices"][0]["message"]["content"] == "A cat."
    [warning] = body[WARNINGS_FIELD]
    assert "messages.0.content.1 (image)" in warning
    assert raw.http_response.headers[WARNING_HEADER] == warning
    assert fake.requests[0].prompt.messages == (ChatMessage("user", "What is this? " + IMAGE),)
    chunks = list(openai_sdk(http).chat.completions.create(model=MODEL, messages=messages,
                                                           stream=True))
    assert [getattr(c, WARNINGS_FIELD) for c in chunks if c.choices[0].finish_reason] == [
        [warning]]


def test_anthropic_image_document_and_tool_result_image() -> None:
    fake, http = app()
    messages: Any = [
        {"role": "user", "content": [
            {"type": "image", "source": PNG},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "x"}},
            {"type": "text", "text": "Read these."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": PNG}]}]},
    ]
    raw = anthropic_sdk(http).messages.with_raw_response.create(
        model=MODEL, max_tokens=64, messages=messages)
    body = raw.http_response.json()
    assert body["content"] == [{"type": "text", "text": "A cat."}]
    [warning] = body[WARNINGS_FIELD]
    for where in ("messages.0.content.0 (image)", "messages.0.content.1 (document)",
                  "messages.2.content.0.content.0 (image)"):
        assert where in warning
    assert raw.http_response.headers[WARNING_HEADER] == warning
    user, _, result = fake.requests[0].prompt.messages
    assert user.content == IMAGE + placeholder("document") + "Read these."
    assert (result.role, result.content) == ("tool", IMAGE)
    with http.stream("POST", "/v1/messages", json={
            "model": MODEL, "max_tokens": 64, "stream": True, "messages": messages}) as response:
        assert response.headers[WARNING_HEADER] == warning
        deltas = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and '"message_delta"' in line]
    assert [d[WARNINGS_FIELD] for d in deltas] == [[warning]]


def test_anthropic_image_only_message_is_not_empty() -> None:
    fake, http = app()
    anthropic_sdk(http).messages.create(model=MODEL, max_tokens=64, messages=[
        {"role": "user", "content": [{"type": "image", "source": PNG}]}])
    assert fake.requests[0].prompt.messages == (ChatMessage("user", IMAGE),)


def test_responses_input_image_and_file() -> None:
    fake, http = app()
    items: Any = [{"role": "user", "content": [
        {"type": "input_text", "text": "Compare: "},
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
        {"type": "input_file", "file_id": "file_1"}]}]
    raw = openai_sdk(http).responses.with_raw_response.create(model=MODEL, input=items)
    body = raw.http_response.json()
    assert body["output"][0]["content"][0]["text"] == "A cat."
    [warning] = body[WARNINGS_FIELD]
    assert "input.0.content.1 (image)" in warning and "input.0.content.2 (file)" in warning
    assert raw.http_response.headers[WARNING_HEADER] == warning
    assert fake.requests[0].prompt.messages == (
        ChatMessage("user", "Compare: " + IMAGE + placeholder("file")),)
