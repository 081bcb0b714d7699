"""RayModelClient's bounded wait for a replica, over fake handles (no Ray instance).

Serve keeps a request for a deployment with no running replica queued without limit; the
client turns a wait past `replica_wait_s` into an overloaded error and cancels the request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deployments.model_clients import RayModelClient
from ingress.client import ModelCard
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    TextPrompt,
    Usage,
)
from replicas.errors import OverloadedError
from tests.streams import collect

pytestmark = pytest.mark.cluster

REQUEST = GenerationRequest(request_id="r1", model="m", prompt=TextPrompt("hi"))
EVENTS: list[OutputEvent] = [TextDelta(Channel.ANSWER, "hello"),
                             Finished(FinishReason.EOS, Usage(1, 1))]


class FakeStream:
    """A streaming handle's response: `batches` in order, or nothing ever (no replica)."""

    def __init__(self, batches: list[list[OutputEvent]] | None) -> None:
        self._batches = batches
        self.cancelled = False

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> list[OutputEvent]:
        if self._batches is None:
            await asyncio.Event().wait()  # queued forever
        assert self._batches is not None
        if not self._batches:
            raise StopAsyncIteration
        return self._batches.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeCall:
    def __init__(self, result: tuple[int, ...] | None) -> None:
        self._result = result
        self.cancelled = False

    def __await__(self) -> Any:
        return self._get().__await__()

    async def _get(self) -> tuple[int, ...]:
        if self._result is None:
            await asyncio.Event().wait()
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        self.cancelled = True


class FakeMethod:
    def __init__(self, response: Any) -> None:
        self.response = response

    def remote(self, *args: Any) -> Any:
        return self.response


class FakeHandle:
    def __init__(self, stream: FakeStream, call: FakeCall) -> None:
        self.stream = FakeMethod(stream)
        self.tokenize = FakeMethod(call)

    def options(self, **_: Any) -> "FakeHandle":
        return self


def client(stream: FakeStream, call: FakeCall | None = None) -> RayModelClient:
    handle = FakeHandle(stream, call or FakeCall((1,)))
    return RayModelClient([ModelCard("m")], {"m": handle}, replica_wait_s=0.2)  # type: ignore[dict-item]


def test_no_replica_is_an_overloaded_error_and_cancels_the_request() -> None:
    stream = FakeStream(None)
    events = asyncio.run(asyncio.wait_for(collect(client(stream).stream(REQUEST)), 5))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].kind is ErrorKind.OVERLOADED
    assert "no replica of the model 'm' took the request within 0.2 s" in events[0].message
    assert stream.cancelled


def test_an_accepting_replica_streams_every_event_after_its_marker() -> None:
    stream = FakeStream([[], [EVENTS[0]], [EVENTS[1]]])
    assert asyncio.run(collect(client(stream).stream(REQUEST))) == EVENTS
    assert not stream.cancelled


def test_tokenize_waits_boundedly_too() -> None:
    call = FakeCall(None)
    with pytest.raises(OverloadedError, match="no replica of the model 'm'"):
        asyncio.run(client(FakeStream([]), call).tokenize(REQUEST))
    assert call.cancelled
    assert asyncio.run(client(FakeStream([]), FakeCall((7, 8))).tokenize(REQUEST)) == (7, 8)
