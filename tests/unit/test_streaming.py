"""The one SSE loop every protocol streams through: errors mid-stream, pings while the
replica is silent, streams cut short, and a client that leaves cancelling its generation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ingress import streaming
from ingress.app import create_app
from ingress.registry import PROTOCOLS, protocol_for
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    Usage,
)
from replicas.errors import InternalError
from tests.fakes import FakeClient, Step

PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
         "responses": "/v1/responses"}
DONE = Finished(FinishReason.EOS, Usage(3, 2))


def body(protocol: str) -> dict[str, Any]:
    if protocol == "responses":
        return {"model": "orchard-tiny", "input": "hi", "stream": True}
    chat = {"model": "orchard-tiny", "messages": [{"role": "user", "content": "hi"}],
            "stream": True}
    return chat | {"max_tokens": 9} if protocol == "anthropic" else chat


def frames(text: str) -> list[tuple[str | None, Any]]:
    """(event name, data) per frame; comment lines (OpenAI-style pings) as (":", text)."""
    found: list[tuple[str | None, Any]] = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            found.append((":", block[1:].strip()))
            continue
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = lines["data"]
        found.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    return found


def post(protocol: str, script: list[Step], **fake: Any) -> list[tuple[str | None, Any]]:
    response = TestClient(create_app(FakeClient(script, **fake))).post(PATHS[protocol],
                                                                       json=body(protocol))
    assert response.status_code == 200
    return frames(response.text)


def error_message(protocol: str, last: tuple[str | None, Any]) -> str:
    name, data = last
    if protocol == "responses":
        assert name == "response.failed" and data["response"]["status"] == "failed"
        return str(data["response"]["error"]["message"])
    assert (name == "error") == (protocol == "anthropic")
    return str(data["error"]["message"])


def test_every_protocol_is_registered_once_by_its_paths() -> None:
    assert sorted(p.name for p in PROTOCOLS) == sorted(PATHS)
    for name, path in PATHS.items():
        assert protocol_for({"path": path, "root_path": ""}).name == name
        assert protocol_for({"path": "/x" + path, "root_path": "/x"}).name == name
    assert protocol_for({"path": "/v1/models"}).name == "openai"


@pytest.mark.parametrize("protocol", PATHS)
@pytest.mark.parametrize("failure", [InternalError("engine fault"),
                                     Failed(ErrorKind.INTERNAL, "engine fault")])
def test_a_failure_mid_stream_ends_it_with_the_protocols_error(protocol: str,
                                                               failure: Step) -> None:
    found = post(protocol, [TextDelta(Channel.ANSWER, "partial"), failure])
    assert "partial" in json.dumps([data for _, data in found])  # it was streaming
    assert error_message(protocol, found[-1]) == "engine fault"
    assert (None, "[DONE]") not in found


@pytest.mark.parametrize("protocol", PATHS)
def test_a_stream_cut_short_ends_with_an_error(protocol: str) -> None:
    found = post(protocol, [TextDelta(Channel.ANSWER, "partial")])
    assert error_message(protocol, found[-1]) == "the model stream ended unexpectedly"


@pytest.mark.parametrize("protocol", PATHS)
def test_a_silent_replica_gets_the_protocols_pings(protocol: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "PING_INTERVAL_S", 0.01)
    script: list[Step] = [TextDelta(Channel.ANSWER, "a"), TextDelta(Channel.ANSWER, "b"), DONE]
    found = post(protocol, script, delay_s=0.08)
    ping = ("ping", {"type": "ping"}) if protocol == "anthropic" else (":", "ping")
    assert ping in found and found.index(ping) > 0
    rest = [frame for frame in found if frame != ping]
    quiet = post(protocol, script)  # the same stream, never idle
    assert [name for name, _ in rest] == [name for name, _ in quiet] and len(rest) == len(quiet)


@pytest.mark.parametrize("protocol", PATHS)
def test_a_finished_stream_is_not_cancelled(protocol: str) -> None:
    fake = FakeClient([TextDelta(Channel.ANSWER, "a"), DONE])
    TestClient(create_app(fake)).post(PATHS[protocol], json=body(protocol))
    assert fake.closed_early == 0


@pytest.mark.parametrize("protocol", PATHS)
def test_a_client_that_leaves_cancels_the_generation(protocol: str) -> None:
    script: list[OutputEvent] = [TextDelta(Channel.ANSWER, "a"), TextDelta(Channel.ANSWER, "b"),
                                 DONE]
    fake = FakeClient(script, delay_s=30)
    app = create_app(fake)
    payload = json.dumps(body(protocol)).encode()
    first_chunk = asyncio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()

    path = PATHS[protocol]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("testserver", 80),
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver"),
                    (b"content-length", str(len(payload)).encode())],
    }

    async def closed_when_the_response_ends() -> int:
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
        return fake.closed_early

    assert asyncio.run(closed_when_the_response_ends()) == 1
