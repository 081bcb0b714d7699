"""Error hygiene and deadlines at the edge: generic 500s, protocol error events, 504s."""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.options import EdgeOptions
from replicas.contract import (
    Channel,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    Usage,
)
from tests.fakes import FakeClient

SECRET = "the prompt says 'open sesame'"
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
         "responses": "/v1/responses"}
PROTOCOLS = list(PATHS)


def body(protocol: str, stream: bool) -> dict[str, Any]:
    if protocol == "responses":
        return {"model": "orchard-tiny", "input": SECRET, "stream": stream}
    payload = {"model": "orchard-tiny", "messages": [{"role": "user", "content": SECRET}],
               "stream": stream}
    return {**payload, "max_tokens": 50} if protocol == "anthropic" else payload


class Crashing(FakeClient):
    """A client that fails with an unexpected exception after `good` events."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        for _ in range(self.good):
            yield [TextDelta(Channel.ANSWER, "partial ")]
        raise RuntimeError(f"bug while handling {SECRET}")


def events(text: str) -> list[tuple[str | None, Any]]:
    found = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            continue  # a keep-alive comment
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = lines["data"]
        found.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    return found


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_error_before_any_byte_is_a_generic_500(
    protocol: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    response = TestClient(create_app(Crashing(good=0))).post(PATHS[protocol],
                                                             json=body(protocol, stream))
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == ("api_error" if protocol == "anthropic" else "internal_error")
    assert error["message"].startswith("internal error (request id ")
    assert "sesame" not in response.text and "Traceback" not in response.text
    error_id = error["message"].rsplit(" ", 1)[1].rstrip(")")
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(error_id in r.getMessage() and "RuntimeError" in r.getMessage() for r in logged)
    assert all("sesame" not in r.getMessage() for r in logged)  # frames, not the message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_unexpected_error_mid_stream_ends_it_with_a_generic_error_event(protocol: str) -> None:
    response = TestClient(create_app(Crashing(good=2))).post(PATHS[protocol],
                                                             json=body(protocol, True))
    assert response.status_code == 200  # already sent when the error struck
    name, last = events(response.text)[-1]
    assert last["error"]["message"].startswith("internal error (request id ")
    assert (name == "error") == (protocol != "openai")  # Responses: its `error` event
    assert "sesame" not in response.text and "Traceback" not in response.text


SLOW = [TextDelta(Channel.ANSWER, f"{i} ") for i in range(20)] + [
    Finished(FinishReason.LENGTH, Usage(3, 20))]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stream_past_its_deadline_ends_with_a_timeout_event_and_is_cancelled(
    protocol: str,
) -> None:
    fake = FakeClient(SLOW, delay_s=0.1)
    http = TestClient(create_app(fake, EdgeOptions(request_timeout_s=0.5)))
    response = http.post(PATHS[protocol], json=body(protocol, True))
    assert response.status_code == 200
    found = events(response.text)
    assert any("delta" in json.dumps(data) for _, data in found)  # it was streaming
    name, last = found[-1]
    assert last["error"]["type"] == "timeout_error"
    assert (name == "error") == (protocol != "openai")  # Responses: its `error` event
    assert fake.closed_early == 1  # the generation was cancelled, not left running


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_whole_response_past_its_deadline_is_a_504(protocol: str) -> None:
    fake = FakeClient(SLOW, delay_s=0.1)
    http = TestClient(create_app(fake, EdgeOptions(request_timeout_s=0.5)))
    response = http.post(PATHS[protocol], json=body(protocol, False))
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"
    assert fake.closed_early == 1


def test_requests_within_the_deadline_are_untouched() -> None:
    fake = FakeClient(SLOW, delay_s=0.01)
    http = TestClient(create_app(fake, EdgeOptions(request_timeout_s=5)))
    response = http.post(PATHS["openai"], json=body("openai", True))
    assert events(response.text)[-1] == (None, "[DONE]")
    assert fake.closed_early == 0
