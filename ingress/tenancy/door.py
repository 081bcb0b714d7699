"""Tenants at the door: the key's tenant, its limits, its priority and its usage.

`TenantMiddleware` takes the place of `ingress.auth.ApiKeyMiddleware` when tenants are
configured: a key in no tenant is a 401; the request's tenant (its "seat") is kept for the
rest of the request, and every response carries OpenAI's `x-ratelimit-*` headers for the
tenant's limits. `TenantClient` wraps the model client: a model the tenant may not use is a
404 (OpenAI's answer for a model a key cannot see), a request past a limit is a 429 with
`Retry-After`, and an admitted one goes to the replica with its tenancy (tenant, share and
the priority it may have lowered), its tokens spent as they stream and counted in usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingress.auth import OPEN_PATHS, ApiKeys, challenge, presented_keys
from ingress.client import ModelClient, WrappedClient
from ingress.errors import error_response
from ingress.observe import note_tenant
from ingress.registry import protocol_for, route_path
from ingress.tenancy.ledger import Ledger
from ingress.tenancy.policy import PRIORITY_HEADER, TenantPolicy
from ingress.tenancy.seat import SEAT, Seat, refuse_outside
from ingress.tenancy.usage import MemoryUsageStore, UsageCounts, UsageStore
from ingress.tenancy.shared import SharedCounts, SharedLedger
from replicas.contract import (EmbeddingRequest, EmbeddingResult, ErrorKind, Finished,
                               GenerationRequest, OutputEvent, RerankRequest, RerankResult,
                               Tenancy, TextDelta, ToolCallDelta)

log = logging.getLogger(__name__)


class TenantKeys:
    """Key -> tenant, compared as digests in constant time (`ingress.auth.ApiKeys`)."""

    def __init__(self, tenants: Iterable[TenantPolicy]) -> None:
        self.tenants = tuple(tenants)
        self._keys = tuple((ApiKeys(t.keys), t) for t in self.tenants)
        self.by_name = {t.name: t for t in self.tenants}

    def __bool__(self) -> bool:
        return bool(self.tenants)

    def __repr__(self) -> str:
        return f"TenantKeys({', '.join(t.name for t in self.tenants)})"

    def tenant_of(self, presented: Iterable[str]) -> TenantPolicy | None:
        found = None
        for key in presented:
            for keys, tenant in self._keys:  # every one: timing does not tell which matched
                if keys.accepts(key) and found is None:
                    found = tenant
        return found


class TenantMiddleware:
    def __init__(self, app: ASGIApp, tenants: TenantKeys, ledger: Ledger) -> None:
        self.app = app
        self.tenants = tenants
        self.ledger = ledger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope["headers"])
        policy = self.tenants.tenant_of(presented)
        if policy is None:
            message = ("invalid API key" if presented else "an API key is required: send "
                       "`Authorization: Bearer KEY` or `x-api-key: KEY`")
            response = error_response(ErrorKind.UNAUTHORIZED, message, protocol_for(scope))
            response.headers["WWW-Authenticate"] = challenge(scope)
            await response(scope, receive, send)
            return
        raw = next((v for n, v in scope["headers"] if n == PRIORITY_HEADER), None)
        asked: int | None = None
        if raw is not None:
            try:
                asked = int(raw.decode("latin-1").strip())
            except ValueError:
                response = error_response(ErrorKind.INVALID_REQUEST, "x-orchard-priority must "
                                          "be an integer", protocol_for(scope),
                                          param="x-orchard-priority")
                await response(scope, receive, send)
                return
        note_tenant(policy.name)
        token = SEAT.set(Seat(policy, asked))

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  *self.ledger.headers(policy)]}
            await send(message)

        try:
            await self.app(scope, receive, with_headers)
        finally:
            SEAT.reset(token)


class TenantClient(WrappedClient):
    def __init__(self, inner: ModelClient, tenants: TenantKeys, ledger: Ledger,
                 usage: UsageStore) -> None:
        super().__init__(inner)
        self._tenants = tenants
        self._ledger = ledger
        self._usage = usage
        self._writes: set[asyncio.Task[None]] = set()

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        seat = SEAT.get()
        if seat is None:  # an open path: the default tenancy, no limits
            return self._counted(self._inner.stream(request), None, request.model)
        policy = self._allowed(request.model)
        tenancy = Tenancy(policy.name, policy.effective_priority(seat.asked_priority),
                          policy.share)
        return self._admitted(policy, dataclasses.replace(request, tenancy=tenancy))

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        result: EmbeddingResult = await self._unary(request.model, self._inner.embed, request)
        return result

    async def rerank(self, request: RerankRequest) -> RerankResult:
        result: RerankResult = await self._unary(request.model, self._inner.rerank, request)
        return result

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        # `/tokenize` and Anthropic's count_tokens: the tenant's models, as generation.
        if SEAT.get() is not None:
            self._allowed(request.model)
        return await self._inner.tokenize(request, add_special_tokens)

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        if SEAT.get() is not None:
            self._allowed(model)
        return await self._inner.detokenize(model, token_ids)

    def _allowed(self, model: str) -> TenantPolicy:
        """The current request's tenant, or the 404 of a model it may not use."""
        seat = SEAT.get()
        assert seat is not None
        refuse_outside(self._inner.resolve, seat.policy, model)
        return seat.policy

    async def _admitted(self, policy: TenantPolicy, request: GenerationRequest
                        ) -> AsyncIterator[list[OutputEvent]]:
        # Admitted on the first read, which the routes await before answering: a refusal
        # is still a 429, and a shared ledger's seat is an await.
        await self._ledger.admit(policy)
        try:
            events = self._inner.stream(request)
        except BaseException:
            self._ledger.leave(policy.name)
            raise
        counted = self._counted(events, policy.name, request.model)
        try:
            async for batch in counted:
                yield batch
        finally:  # closing us closes it now: its seat is given back, its generation ended
            await counted.aclose()

    async def _unary(self, model: str, call: Callable[[Any], Awaitable[Any]],
                     request: Any) -> Any:
        """An embedding or rerank call: the tenant's models, its limits (its prompt tokens
        spent), its usage."""
        if SEAT.get() is None:  # an open path: the default tenancy, no limits
            return await call(request)
        policy = self._allowed(model)
        await self._ledger.admit(policy)
        tokens = 0
        try:
            result = await call(request)
            tokens = result.prompt_tokens
            return result
        finally:
            self._ledger.spend(policy.name, tokens)
            self._ledger.leave(policy.name)
            self._record(policy.name, model, UsageCounts(1, tokens))

    async def _counted(self, events: AsyncIterator[list[OutputEvent]], tenant: str | None,
                       model: str) -> AsyncGenerator[list[OutputEvent], None]:
        spent, finished = 0, None
        try:
            async for batch in events:
                if tenant is not None:  # a lower bound as it streams; the usage trues it up
                    pieces = sum(isinstance(e, ToolCallDelta) or
                                 isinstance(e, TextDelta) and bool(e.text) for e in batch)
                    self._ledger.spend(tenant, pieces)
                    spent += pieces
                if batch and isinstance(batch[-1], Finished):
                    finished = batch[-1]
                yield batch
        finally:
            name = tenant or "default"
            if tenant is not None:
                if finished is not None:
                    self._ledger.spend(tenant, finished.usage.total_tokens - spent)
                self._ledger.leave(tenant)
            usage = finished.usage if finished is not None else None
            counts = UsageCounts(1, usage.prompt_tokens if usage else 0,
                                 usage.cached_tokens if usage else 0,
                                 usage.completion_tokens if usage else spent,
                                 usage.preemptions if usage else 0)
            self._record(name, model, counts)
            aclose = getattr(events, "aclose", None)
            if aclose is not None:  # closing us cancels the generation, as closing it would
                await aclose()

    def _record(self, tenant: str, model: str, counts: UsageCounts) -> None:
        # A task, not an await: this runs as the stream closes, maybe under cancellation.
        task = asyncio.get_running_loop().create_task(self._usage.add(tenant, model, counts))
        self._writes.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("recording usage failed: %r", task.exception())


def tenanted_client(app: Any, inner: ModelClient, tenants: Iterable[TenantPolicy],
                    usage: UsageStore | None, shared: SharedCounts | None = None
                    ) -> ModelClient:
    """`inner` behind the tenants' door, where tenants are configured; the app's state keeps
    what the middleware and `GET /v1/usage` read (`create_app`). `shared`: where the limits
    are counted when several HTTP replicas serve (`ingress.tenancy.shared`)."""
    app.state.tenants = TenantKeys(tenants)
    app.state.ledger = Ledger() if shared is None else SharedLedger(shared)
    app.state.usage = MemoryUsageStore() if usage is None else usage
    if not app.state.tenants:  # no tenants: nothing to count or limit, nothing wrapped
        return inner
    return TenantClient(inner, app.state.tenants, app.state.ledger, app.state.usage)
