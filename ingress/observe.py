"""One record per finished generation request, for metrics and request logs.

`ObserveMiddleware` wraps every request to a protocol's path and hands an observer one
`RequestRecord` when the response is done (or the client left). `ObservedClient` wraps the
model client and notes what only the event stream knows: the request id, the time of the
first event, the usage and the finish reason. Both paths (streaming and not) read events
through the client, so the record is the same for both. The cost is a few attribute writes
per event batch and one observer call per request, never one per token.
"""

from __future__ import annotations

import logging
import time
import typing
from contextvars import ContextVar
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingress.client import ModelCard, ModelClient, WrappedClient
from ingress.registry import PROTOCOLS, route_path
from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    RerankRequest,
    RerankResult,
    Usage,
)
from replicas.errors import ReplicaError

log = logging.getLogger(__name__)

# The status of a request whose client left before any response (nginx's convention).
CLIENT_CLOSED = 499

_KIND_OF_STATUS = {400: ErrorKind.INVALID_REQUEST, 401: ErrorKind.UNAUTHORIZED,
                   404: ErrorKind.NOT_FOUND, 413: ErrorKind.INVALID_REQUEST,
                   429: ErrorKind.RATE_LIMITED, 503: ErrorKind.OVERLOADED,
                   529: ErrorKind.OVERLOADED, 504: ErrorKind.TIMEOUT}


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. Never the prompt or the output text."""

    request_id: str | None  # None: refused before a generation request was built
    model: str
    protocol: str  # the wire protocol's name: openai, anthropic, responses
    endpoint: str  # the route prefix it came in on, e.g. /v1/chat/completions
    status: int  # the HTTP status; CLIENT_CLOSED when the client left first
    streaming: bool  # answered as an SSE stream
    duration_s: float
    ttft_s: float | None  # to the first generated event
    itl_s: float | None  # mean time between output tokens after the first
    usage: Usage | None
    finish_reason: FinishReason | None
    error: ErrorKind | None
    cancelled: bool  # the generation was stopped before its end (disconnect, deadline)
    tenant: str = "default"  # the API key's tenant (`ingress/tenancy/`)


class RequestObserver(typing.Protocol):
    def request_finished(self, record: RequestRecord) -> None: ...


class NoObserver:
    def request_finished(self, record: RequestRecord) -> None:
        pass


@dataclass(frozen=True)
class FanOut:
    """Several observers as one (metrics and request logs)."""

    observers: tuple[RequestObserver, ...]

    def request_finished(self, record: RequestRecord) -> None:
        for observer in self.observers:
            observer.request_finished(record)


class _Trace:
    """The request's facts as they arrive; mutated by the middleware and the client."""

    __slots__ = ("started", "request_id", "model", "first_at", "last_at", "usage", "reason",
                 "error", "opened", "status", "streaming", "tenant")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.request_id: str | None = None
        self.model: str | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.usage: Usage | None = None
        self.reason: FinishReason | None = None
        self.error: ErrorKind | None = None
        self.opened = False  # a generation was asked for
        self.status: int | None = None
        self.streaming = False
        self.tenant = "default"

    def saw(self, batch: list[OutputEvent]) -> None:
        if not batch:
            return  # the deployment's "accepted" marker
        now = time.perf_counter()
        if self.first_at is None and not isinstance(batch[0], Failed):
            self.first_at = now
        self.last_at = now
        last = batch[-1]  # a terminal event is always a batch's last
        if isinstance(last, Finished):
            self.usage, self.reason = last.usage, last.reason
        elif isinstance(last, Failed):
            self.error = last.kind

    def record(self, protocol: str, endpoint: str, default_model: str) -> RequestRecord:
        ended = time.perf_counter()
        status = self.status if self.status is not None else CLIENT_CLOSED
        error = self.error
        if error is None and status >= 400 and status != CLIENT_CLOSED:
            error = _KIND_OF_STATUS.get(status, ErrorKind.INTERNAL)
        terminal = self.reason is not None or self.error is not None
        cancelled = (self.opened and not terminal) or self.reason == FinishReason.CANCELLED
        ttft = None if self.first_at is None else self.first_at - self.started
        itl = None
        tokens = self.usage.completion_tokens if self.usage is not None else 0
        if self.first_at is not None and self.last_at is not None and tokens > 1:
            itl = (self.last_at - self.first_at) / (tokens - 1)
        return RequestRecord(self.request_id, self.model or default_model, protocol, endpoint,
                             status, self.streaming, ended - self.started, ttft, itl,
                             self.usage, self.reason, error, cancelled, self.tenant)


_TRACE: ContextVar[_Trace | None] = ContextVar("orchard_trace", default=None)


def note_tenant(tenant: str) -> None:
    """The current request's tenant, for its record (called by the tenant middleware)."""
    trace = _TRACE.get()
    if trace is not None:
        trace.tenant = tenant


def _owner(path: str) -> tuple[str, str] | None:
    for protocol in PROTOCOLS:
        for prefix in protocol.prefixes:
            if path.startswith(prefix):
                return protocol.name, prefix
    return None


class ObserveMiddleware:
    """Outermost but CORS, so it sees the guard's 500s and 504s too."""

    def __init__(self, app: ASGIApp, observer: RequestObserver, client: ModelClient) -> None:
        self.app = app
        self.observer = observer
        self.client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = _owner(route_path(scope)) if scope["type"] == "http" else None
        if owner is None:
            await self.app(scope, receive, send)
            return
        trace = _Trace()
        token = _TRACE.set(trace)

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                trace.status = int(message["status"])
                trace.streaming = any(
                    name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            _TRACE.reset(token)
            try:
                record = trace.record(*owner, _default_model(self.client.models()))
                self.observer.request_finished(record)
            except Exception:  # noqa: BLE001 - observing must never fail a request
                log.exception("recording a finished request failed")


def _default_model(cards: Sequence[ModelCard]) -> str:
    # A request refused before its model was read is labelled with the only model, if one.
    return cards[0].id if len(cards) == 1 else "unknown"


class ObservedClient(WrappedClient):
    """A ModelClient that notes each generation's events in the current request's trace."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        trace = _TRACE.get()
        if trace is None:
            return self._inner.stream(request)
        trace.request_id, trace.model = request.request_id, request.model
        try:
            events = self._inner.stream(request)
        except ReplicaError as exc:
            trace.error = exc.kind
            raise
        trace.opened = True
        return _watched(events, trace)

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        trace = _TRACE.get()
        if trace is not None:
            trace.request_id, trace.model = request.request_id, request.model
        return await self._inner.tokenize(request, add_special_tokens)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        return await _forwards(self._inner.embed, request)

    async def rerank(self, request: RerankRequest) -> RerankResult:
        return await _forwards(self._inner.rerank, request)


_Forwarded = typing.TypeVar("_Forwarded", EmbeddingResult, RerankResult)


async def _forwards(call: typing.Callable[[typing.Any], typing.Awaitable[_Forwarded]],
                    request: EmbeddingRequest | RerankRequest) -> _Forwarded:
    """A forwards-only call (embeddings, rerank) noted on the request's trace: the tokens
    it read count as a prompt's (every scored pair's, for a rerank)."""
    trace = _TRACE.get()
    if trace is not None:
        trace.request_id, trace.model = request.request_id, request.model
    try:
        result = await call(request)
    except ReplicaError as exc:
        if trace is not None:
            trace.error = exc.kind
        raise
    if trace is not None:
        trace.usage = Usage(prompt_tokens=result.prompt_tokens, completion_tokens=0)
    return result


async def _watched(events: AsyncIterator[list[OutputEvent]],
                   trace: _Trace) -> AsyncIterator[list[OutputEvent]]:
    try:
        async for batch in events:
            trace.saw(batch)
            yield batch
    except ReplicaError as exc:
        trace.error = exc.kind
        raise
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:  # closing us cancels the generation, as closing it would
            await aclose()
