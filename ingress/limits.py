"""Size limits checked at the edge, before a request costs any replica time.

`BodyLimitMiddleware` answers 413 to a body over the limit, whether it declares its size or
streams it chunked. `LimitedClient` rejects over-long stop lists and stop strings with a 400
before the request is sent to a replica (whose stop matcher grows with the stops' total size).
"""

from __future__ import annotations

from typing import AsyncIterator

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingress.client import ModelClient, WrappedClient
from ingress.errors import edge_error_response
from ingress.options import EdgeOptions
from ingress.registry import protocol_for
from replicas.contract import GenerationRequest, OutputEvent
from replicas.errors import InvalidRequestError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        # Read the body here, so a chunked upload (or a false Content-Length) is cut off at
        # the limit instead of being buffered whole by the JSON parser.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body exceeds the limit of {self.max_bytes} bytes"
        response = edge_error_response(413, message, protocol_for(scope))
        response.headers["Connection"] = "close"  # the rest of the upload is not read
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body as one message, then the real channel (to hear a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class LimitedClient(WrappedClient):
    """A ModelClient that refuses over-limit requests instead of forwarding them."""

    def __init__(self, inner: ModelClient, options: EdgeOptions) -> None:
        super().__init__(inner)
        self._options = options

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        check_stops(request, self._options)
        return self._inner.stream(request)


def check_stops(request: GenerationRequest, options: EdgeOptions) -> None:
    stops = request.stop
    count = len(stops.strings) + len(stops.token_ids)
    if count > options.max_stops:
        raise InvalidRequestError(
            f"at most {options.max_stops} stop sequences (strings and token ids together) "
            f"are allowed per request; got {count}",
            param="stop",
        )
    longest = max((len(s) for s in stops.strings), default=0)
    if longest > options.max_stop_chars:
        raise InvalidRequestError(
            f"stop sequences may be at most {options.max_stop_chars} characters long; "
            f"one has {longest}",
            param="stop",
        )
